"""The etcd v3 client under the coordinator's store: its members, failover and leases.

Talks to etcd's own gRPC API (KV Range/Txn, Lease, Auth Authenticate) with stubs generated from
`protos/etcd/rpc.proto`. Every call has a deadline; a member that does not answer is left for
the next endpoint; when none answers the call raises `StoreUnavailable`, so that the service
answers UNAVAILABLE and retries the write later, and never reports a write it does not know
is committed. A request etcd itself refuses (`EtcdRefused`) is not tried on another member.

A batch of operations is written in txns of at most `MAX_TXN_OPS` operations and
`MAX_TXN_BYTES` bytes, in order, each carrying the `Fence` when there is one: once the fence
fails, `StoreFenced`. What the keys hold is `coordinator._store_etcd`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from coordinator._store import Fence, StoreFenced, StoreUnavailable
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc

CALL_TIMEOUT_S = 5.0
"""Deadline of one etcd call."""
RECONNECT_WAIT_S = 1.5
"""How long a call waits for a connection to a member that could not be reached just before."""
MAX_TXN_OPS = 128
MAX_TXN_BYTES = 1024 * 1024
"""Bytes of keys and values in one txn: under etcd's default 1.5 MiB request limit."""
RANGE_PAGE = 100
MAX_RECEIVE_BYTES = 160 * 1024 * 1024
"""A page of RANGE_PAGE keys fits even when every value is at etcd's 1.5 MiB request limit."""
MAX_PASSWORD_BYTES = 4096

T = TypeVar("T")


class _MemberFailed(Exception):
    def __init__(self, reason: str, unreachable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable
        """UNAVAILABLE: the call may never have reached the member (nothing listened)."""


class EtcdRefused(StoreUnavailable):
    """etcd answered, and refused: asking again (or another member) will not help."""


@dataclass(frozen=True)
class EtcdSettings:
    """Where the etcd cluster is and how to authenticate to it."""

    endpoints: tuple[str, ...]
    """host:port of each member to try, in order."""
    prefix: str
    """Every key of this coordinator's state starts with `prefix/`."""
    ca_file: str = ""
    """PEM CA that signed the members' certificates ("" = plain text, unless cert_file)."""
    cert_file: str = ""
    """PEM client certificate (etcd's --client-cert-auth)."""
    key_file: str = ""
    """PEM private key of cert_file."""
    user: str = ""
    """etcd user to authenticate as ("" = no etcd auth)."""
    password_file: str = field(default="", repr=True)
    """File holding that user's password (the password itself is never in argv or repr)."""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("etcd_cert and etcd_key go together")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("etcd_user and etcd_password_file go together")
        if self.user and (len(self.user) > 128 or not self.user.isprintable()):
            raise ValueError("etcd_user: must be 1-128 printable characters")

    def url(self) -> str:
        return f"etcd://{','.join(self.endpoints)}/{self.prefix}"


def _read_password(path: str) -> str:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read etcd password file {p}: {exc.strerror or exc}") from None
    if len(data) > MAX_PASSWORD_BYTES:
        raise ValueError(f"etcd password file {p} is larger than {MAX_PASSWORD_BYTES} bytes")
    password = data.decode("utf-8", errors="strict").rstrip("\r\n")
    if not password:
        raise ValueError(f"etcd password file {p} is empty")
    return password


def _range_end(prefix: bytes) -> bytes:
    """The key after every key that starts with `prefix`."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def _put(key: bytes, value: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value))


def _delete(key: bytes, end: bytes = b"") -> epb.RequestOp:
    return epb.RequestOp(request_delete_range=epb.DeleteRangeRequest(key=key, range_end=end))


def _op_bytes(op: epb.RequestOp) -> int:
    if op.HasField("request_put"):
        return len(op.request_put.key) + len(op.request_put.value) + 16
    d = op.request_delete_range
    return len(d.key) + len(d.range_end) + 16


class EtcdClient:
    """Calls to the members of one etcd cluster: each on the first member that answers (see the
    module docstring), authenticated when the settings name a user, each txn fenced."""

    def __init__(self, settings: EtcdSettings, *, call_timeout: float = CALL_TIMEOUT_S) -> None:
        settings.validate()
        self.settings = settings
        self._timeout = call_timeout
        self._password = _read_password(settings.password_file) if settings.user else ""
        self._token = ""
        self._fence: Fence | None = None
        """What every txn is conditional on (the store sets it: `EtcdStore.set_fence`)."""
        self._channels: list[grpc.Channel] = []
        self._current = 0
        creds = None
        if settings.tls:

            def read(path: str) -> bytes | None:
                return Path(path).read_bytes() if path else None

            creds = grpc.ssl_channel_credentials(
                read(settings.ca_file), read(settings.key_file), read(settings.cert_file)
            )
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", MAX_TXN_BYTES * 2),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # Reconnect promptly once a restarted member listens again.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ]
        for ep in settings.endpoints:
            if creds is not None:
                self._channels.append(grpc.secure_channel(ep, creds, options))
            else:
                self._channels.append(grpc.insecure_channel(ep, options))
        self._stubs = [epb_grpc.KVStub(ch) for ch in self._channels]
        self._lease_stubs = [epb_grpc.LeaseStub(ch) for ch in self._channels]

    # ---- calls -------------------------------------------------------------------------

    def describe(self) -> str:
        return f"etcd {self.settings.url()}"

    def _call(
        self,
        fn: Callable[[epb_grpc.KVStub, list[tuple[str, str]], dict[str, Any]], T],
        timeout: float = 0.0,
    ) -> T:
        """Run one call on the first member that answers; StoreUnavailable when none does.

        When no member could be connected to, one more round waits (briefly) for a connection:
        a member that just came back is answered by a channel still in its reconnect backoff.
        """
        errors: list[str] = []
        timeout = timeout or self._timeout
        n = len(self._channels)
        unreachable = 0
        for round_ in range(2):
            if round_ == 1 and unreachable < n:
                break
            options: dict[str, Any] = (
                {"timeout": timeout}
                if round_ == 0
                else {"timeout": min(timeout, RECONNECT_WAIT_S), "wait_for_ready": True}
            )
            for i in range(n):
                index = (self._current + i) % n
                try:
                    return self._try(fn, index, options)
                except _MemberFailed as exc:
                    errors.append(f"{self.settings.endpoints[index]}: {exc.reason}")
                    unreachable += round_ == 0 and exc.unreachable
        raise StoreUnavailable(f"etcd is unavailable ({'; '.join(errors)[:600]})")

    def _try(
        self,
        fn: Callable[[epb_grpc.KVStub, list[tuple[str, str]], dict[str, Any]], T],
        index: int,
        options: dict[str, Any],
    ) -> T:
        """fn's result on member `index`; _MemberFailed when that member did not answer."""
        for attempt in range(2):
            try:
                if self.settings.user and not self._token:
                    self._authenticate(index)
                metadata = [("token", self._token)] if self._token else []
                result = fn(self._stubs[index], metadata, options)
                self._current = index
                return result
            except EtcdRefused:
                raise
            except StoreUnavailable as exc:  # this member did not answer Authenticate
                raise _MemberFailed(str(exc), False) from None
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
                if (
                    self.settings.user
                    and attempt == 0
                    and (
                        code == grpc.StatusCode.UNAUTHENTICATED
                        or "auth token" in details
                        or "user name is empty" in details
                    )
                ):
                    self._token = ""  # expired or unknown to etcd: fetch a new one, once
                    continue
                if code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAUTHENTICATED,
                ):
                    # etcd refused the request itself: another member would as well.
                    raise EtcdRefused(
                        f"etcd refused the request ({code.name}: {details[:300]})"
                    ) from None
                raise _MemberFailed(
                    f"{code.name if code else exc} {details[:200]}",
                    code == grpc.StatusCode.UNAVAILABLE,
                ) from None
        raise _MemberFailed("refused the renewed token", False)

    def _authenticate(self, index: int) -> None:
        stub = epb_grpc.AuthStub(self._channels[index])
        try:
            resp = stub.Authenticate(
                epb.AuthenticateRequest(name=self.settings.user, password=self._password),
                timeout=self._timeout,
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
            error = (
                EtcdRefused
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
                else StoreUnavailable
            )
            raise error(
                f"could not authenticate to etcd as {self.settings.user!r} "
                f"({code.name if code else exc}: {details[:200]})"
            ) from None
        self._token = resp.token

    def _range(self, prefix: bytes, page: int = RANGE_PAGE) -> list[epb.KeyValue]:
        """Every key under `prefix`, read page by page at one revision."""
        end = _range_end(prefix)
        start, revision = prefix, 0
        kvs: list[epb.KeyValue] = []
        while True:
            req = epb.RangeRequest(key=start, range_end=end, limit=page, revision=revision)
            resp = self._read(req)
            revision = revision or resp.header.revision
            kvs.extend(resp.kvs)
            if not resp.more or not resp.kvs:
                return kvs
            start = resp.kvs[-1].key + b"\0"

    def _read(self, req: epb.RangeRequest) -> epb.RangeResponse:
        resp: epb.RangeResponse = self._call(
            lambda kv, md, options: kv.Range(req, metadata=md, **options)
        )
        return resp

    def _get(self, key: bytes) -> epb.KeyValue | None:
        resp = self._read(epb.RangeRequest(key=key))
        return resp.kvs[0] if resp.kvs else None

    def _txn(self, ops: list[epb.RequestOp]) -> None:
        compare = []
        fence = self._fence
        if fence is not None:
            compare.append(
                epb.Compare(
                    result=epb.Compare.EQUAL,
                    target=epb.Compare.CREATE,
                    key=fence.key,
                    create_revision=fence.create_revision,
                )
            )
        req = epb.TxnRequest(compare=compare, success=ops)
        resp: epb.TxnResponse = self._call(
            lambda kv, md, options: kv.Txn(req, metadata=md, **options)
        )
        if not resp.succeeded:
            raise StoreFenced(
                f"etcd refused a write: key {fence.key!r:.200} no longer has creation revision "
                f"{fence.create_revision} (another coordinator leads)"
                if fence is not None
                else "etcd refused a write"
            )

    def _commit(self, ops: list[epb.RequestOp]) -> None:
        """Write `ops` in order, in as few txns within the bounds as will hold them."""
        batch: list[epb.RequestOp] = []
        size = 0
        for op in ops:
            n = _op_bytes(op)
            if batch and (len(batch) >= MAX_TXN_OPS or size + n > MAX_TXN_BYTES):
                self._txn(batch)
                batch, size = [], 0
            batch.append(op)
            size += n
        if batch:
            self._txn(batch)

    # ---- leases (the election: coordinator/_leader.py) ---------------------------------

    def _lease_stub(self, kv: epb_grpc.KVStub) -> epb_grpc.LeaseStub:
        return self._lease_stubs[self._stubs.index(kv)]

    def grant_lease(self, ttl: int, timeout: float = 0.0) -> tuple[int, int]:
        """A new lease of `ttl` seconds: (its id, the TTL etcd granted)."""
        req = epb.LeaseGrantRequest(TTL=ttl)
        resp: epb.LeaseGrantResponse = self._call(
            lambda kv, md, options: self._lease_stub(kv).LeaseGrant(req, metadata=md, **options),
            timeout,
        )
        if resp.error or resp.ID == 0:
            raise EtcdRefused(f"etcd granted no lease: {resp.error[:200]}")
        return resp.ID, resp.TTL

    def keep_alive(self, lease_id: int, timeout: float) -> int:
        """Refresh the lease once; the TTL etcd answered (0: the lease is gone)."""

        def once(kv: epb_grpc.KVStub, md: list[tuple[str, str]], options: dict[str, Any]) -> int:
            call = self._lease_stub(kv).LeaseKeepAlive(
                iter([epb.LeaseKeepAliveRequest(ID=lease_id)]), metadata=md, **options
            )
            try:
                for resp in call:
                    ttl: int = resp.TTL
                    return ttl
                return 0
            finally:
                call.cancel()

        return self._call(once, timeout)

    def revoke_lease(self, lease_id: int, timeout: float = 0.0) -> None:
        """Revoke the lease (its keys go at once); a lease etcd no longer knows is no error."""
        req = epb.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call(
                lambda kv, md, options: self._lease_stub(kv).LeaseRevoke(
                    req, metadata=md, **options
                ),
                timeout,
            )
        except StoreUnavailable as exc:
            if "lease not found" not in str(exc):
                raise

    def read_key(self, key: bytes, timeout: float = 0.0) -> epb.KeyValue | None:
        resp: epb.RangeResponse = self._call(
            lambda kv, md, options: kv.Range(epb.RangeRequest(key=key), metadata=md, **options),
            timeout,
        )
        return resp.kvs[0] if resp.kvs else None

    def create_with_lease(
        self, key: bytes, value: bytes, lease_id: int, timeout: float = 0.0
    ) -> tuple[int, epb.KeyValue | None]:
        """Put `key` with the lease only if the key does not exist (never fenced): (its
        creation revision, None) when made, else (0, the key as it is)."""
        req = epb.TxnRequest(
            compare=[
                epb.Compare(
                    result=epb.Compare.EQUAL,
                    target=epb.Compare.CREATE,
                    key=key,
                    create_revision=0,
                )
            ],
            success=[
                epb.RequestOp(request_put=epb.PutRequest(key=key, value=value, lease=lease_id))
            ],
            failure=[epb.RequestOp(request_range=epb.RangeRequest(key=key))],
        )
        resp: epb.TxnResponse = self._call(
            lambda kv, md, options: kv.Txn(req, metadata=md, **options), timeout
        )
        if resp.succeeded:
            revision: int = resp.header.revision
            return revision, None
        kvs = resp.responses[0].response_range.kvs if resp.responses else []
        return 0, kvs[0] if kvs else None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels = []
