"""The coordinator's durable state in etcd v3: one key per job, event, node and meta value.

Talks to etcd's own gRPC API (KV Range/Txn, Lease, Auth Authenticate) with stubs generated from
`protos/etcd/rpc.proto`. Every call has a deadline; a member that does not answer is left for
the next endpoint; when none answers the call raises `StoreUnavailable`, so that the service
answers UNAVAILABLE and retries the write later, and never reports a write it does not know
is committed.

Layout under `PREFIX/` (key parts percent-encoded, values JSON):

    meta/NAME                 a meta value: {"value": "..."}
    jobs/JOB                  {"submitted_at": ts, "state": "...", "doc": {...}}
    events/JOB/SEQ            an event (SEQ zero-padded to 20 digits, so keys sort by number)
    nodes/NAME                a node as last seen
    quarantine/NS-N           a record that could not be read, moved aside with the reason
    parts/KEY/ID/N            pieces of a value too large for one request (see below)
    leader                    the leading replica {"id", "addr"}, on its lease (_leader.py)

Bounds: etcd refuses a request over `--max-request-bytes` (1.5 MiB by default) and a txn with
more than `--max-txn-ops` operations (128). A batch is written in txns of at most
`MAX_TXN_OPS` operations and `MAX_TXN_BYTES` bytes, in order: meta first (the event-number
reservation goes before the events that use it), then each job's events before the job, then
nodes, then deletions. A value larger than `PART_BYTES` is written as pieces under a fresh id
first and the key then points at them, in the txn that also deletes the older pieces; so a key
always reads whole, as it was before or after. Between two txns of one batch a crash can leave
part of the batch written; nothing of that batch had been acted on yet (the service sends and
answers only after the whole save).

Every txn carries the store's `Fence` when it has one: once the fence fails, `StoreFenced`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from coordinator._store import (
    SCHEMA_VERSION,
    Fence,
    StoredState,
    StoreFenced,
    StoreUnavailable,
)
from protos.etcd import rpc_pb2 as epb
from protos.etcd import rpc_pb2_grpc as epb_grpc

__all__ = ["SECTIONS", "EtcdRefused", "EtcdSettings", "EtcdStore", "parse_etcd_url"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
"""Deadline of one etcd call."""
RECONNECT_WAIT_S = 1.5
"""How long a call waits for a connection to a member that could not be reached just before."""
CONNECT_WAIT_S = 30.0
"""How long opening the store waits for etcd to answer before it gives up."""
MAX_TXN_OPS = 128
MAX_TXN_BYTES = 1024 * 1024
"""Bytes of keys and values in one txn: under etcd's default 1.5 MiB request limit."""
PART_BYTES = 512 * 1024
"""A value larger than this is written in pieces of this size."""
MAX_VALUE_BYTES = 512 * 1024 * 1024
"""A value larger than this is refused: no job should ever need it."""
RANGE_PAGE = 100
PART_PAGE = 8
MAX_RECEIVE_BYTES = 160 * 1024 * 1024
"""A page of RANGE_PAGE keys fits even when every value is at etcd's 1.5 MiB request limit."""
MAX_ENDPOINTS = 16
MAX_PASSWORD_BYTES = 4096
QUARANTINE_DATA_BYTES = 256 * 1024
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}(/[A-Za-z0-9_.\-]{1,64}){0,7}")
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
_PARTS = "__parts__"
SECTIONS = frozenset({"meta", "jobs", "events", "nodes", "quarantine", "parts", "leader"})
"""The names directly under a store's prefix. A prefix with one of them as a part would nest
one store inside another's section (`x/jobs` inside the `jobs` of `x`): the outer one would
read the inner one's keys as its own records, and move them aside as bad ones."""

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


def parse_etcd_url(url: str) -> tuple[tuple[str, ...], str]:
    """(endpoints, prefix) of `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`; ValueError naming the
    bad part."""
    if len(url) > 2048:
        raise ValueError("store: the etcd URL is longer than 2048 characters")
    scheme, sep, rest = url.partition("://")
    if scheme != "etcd" or not sep:
        raise ValueError(
            f"store: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX, got {url!r:.120}"
        )
    hosts, slash, prefix = rest.partition("/")
    if "@" in hosts:
        raise ValueError(
            "store: put no user or password in the URL: use --etcd-user and --etcd-password-file"
        )
    if not slash or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            "store: the etcd URL needs a key prefix after the hosts (1-8 /-separated parts of "
            f"[A-Za-z0-9_.-]), got {prefix!r:.80}"
        )
    if any(part in (".", "..") for part in prefix.split("/")):
        raise ValueError(f"store: prefix parts must not be . or .., got {prefix!r:.80}")
    taken = [part for part in prefix.split("/") if part in SECTIONS]
    if taken:
        raise ValueError(
            f"store: prefix parts must not be the store's own section names "
            f"({', '.join(sorted(SECTIONS))}), got {taken[0]!r} in {prefix!r:.80}"
        )
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not _HOST.fullmatch(host) or not port.isdigit():
            raise ValueError(f"store: expected HOST:PORT, got {item!r:.80}")
        if not 0 < int(port) < 65536:
            raise ValueError(f"store: port must be 1-65535, got {port}")
        endpoints.append(f"{host}:{int(port)}")
    if not 1 <= len(endpoints) <= MAX_ENDPOINTS:
        raise ValueError(f"store: give 1-{MAX_ENDPOINTS} etcd endpoints, got {len(endpoints)}")
    return tuple(endpoints), prefix


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


def _q(part: str) -> bytes:
    return urllib.parse.quote(part, safe="").encode("ascii")


def _unq(part: bytes) -> str:
    return urllib.parse.unquote(part.decode("ascii", errors="replace"))


def _range_end(prefix: bytes) -> bytes:
    """The key after every key that starts with `prefix`."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _put(key: bytes, value: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value))


def _delete(key: bytes, end: bytes = b"") -> epb.RequestOp:
    return epb.RequestOp(request_delete_range=epb.DeleteRangeRequest(key=key, range_end=end))


def _op_bytes(op: epb.RequestOp) -> int:
    if op.HasField("request_put"):
        return len(op.request_put.key) + len(op.request_put.value) + 16
    d = op.request_delete_range
    return len(d.key) + len(d.range_end) + 16


class EtcdStore:
    """A thread-safe handle on the coordinator's keys in etcd (see the module docstring)."""

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        call_timeout: float = CALL_TIMEOUT_S,
        connect_wait: float = CONNECT_WAIT_S,
    ) -> None:
        settings.validate()
        self.settings = settings
        self._timeout = call_timeout
        self._password = _read_password(settings.password_file) if settings.user else ""
        self._token = ""
        self._lock = threading.Lock()
        self._fence: Fence | None = None
        self._root = settings.prefix.encode("ascii") + b"/"
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
        self._parted: set[bytes] = set()
        """Keys whose value lives in pieces (their pieces go when they are rewritten)."""
        self._part_id = 0
        self._loaded: dict[tuple[str, Any], bytes] = {}
        """etcd key of each record the last `load` returned, by (table, StoredState key)."""
        deadline = time.monotonic() + connect_wait
        while True:
            try:
                self._migrate()
                break
            except StoreUnavailable as exc:
                if isinstance(exc, EtcdRefused):
                    self.close()
                    raise
                if time.monotonic() >= deadline:
                    self.close()
                    raise StoreUnavailable(
                        f"{exc} (waited {connect_wait:.0f} s for etcd to answer)"
                    ) from None
                logger.warning("waiting for etcd: %s", exc)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            except BaseException:
                self.close()
                raise

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

    # ---- keys ----------------------------------------------------------------------------

    def _key(self, section: str, *parts: str) -> bytes:
        return self._root + section.encode("ascii") + b"/" + b"/".join(_q(p) for p in parts)

    def _event_key(self, job_id: str, seq: int) -> bytes:
        return self._key("events", job_id) + b"/" + f"{seq:020d}".encode("ascii")

    def _parts_prefix(self, key: bytes) -> bytes:
        return self._root + b"parts/" + _q(key[len(self._root) :].decode("ascii")) + b"/"

    def _put_value(
        self, key: bytes, value: bytes, early: list[epb.RequestOp]
    ) -> list[epb.RequestOp]:
        """Ops that make `value` the key's, with the deletion of its older pieces; the pieces
        of a large value go to `early`, to be written before."""
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {len(value)} bytes for {key!r:.120} is too large")
        parts = self._parts_prefix(key)
        if len(value) <= PART_BYTES:
            if key not in self._parted:
                return [_put(key, value)]
            self._parted.discard(key)
            return [_put(key, value), _delete(parts, _range_end(parts))]
        self._part_id = max(self._part_id + 1, time.time_ns())
        pid = f"{self._part_id:020d}".encode("ascii")
        pieces = range(0, len(value), PART_BYTES)
        early.extend(
            _put(parts + pid + b"/" + f"{i:06d}".encode("ascii"), value[at : at + PART_BYTES])
            for i, at in enumerate(pieces)
        )
        pointer = {
            _PARTS: {
                "id": pid.decode("ascii"),
                "n": len(pieces),
                "bytes": len(value),
                "sha256": hashlib.sha256(value).hexdigest(),
            }
        }
        self._parted.add(key)
        # Ids grow, so every older id of this key sorts before this one: one range deletes them.
        return [_put(key, _dumps(pointer)), _delete(parts, parts + pid)]

    def _forget_ops(self, key: bytes) -> list[epb.RequestOp]:
        ops = [_delete(key)]
        if key in self._parted:
            parts = self._parts_prefix(key)
            ops.append(_delete(parts, _range_end(parts)))
            self._parted.discard(key)
        return ops

    # ---- leases and the leader key (the election: coordinator/_leader.py) ----------------

    def _lease_stub(self, kv: epb_grpc.KVStub) -> epb_grpc.LeaseStub:
        return self._lease_stubs[self._stubs.index(kv)]

    def leader_key(self) -> bytes:
        return self._root + b"leader"

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

    # ---- the StateStore interface --------------------------------------------------------

    def set_fence(self, fence: Fence | None) -> None:
        with self._lock:
            self._fence = fence

    def _migrate(self) -> None:
        with self._lock:
            key = self._key("meta", "schema_version")
            found = self._get(key)
            if found is not None:
                version = self._meta_value(found.value)
                if version is not None and version.isdigit() and int(version) > SCHEMA_VERSION:
                    raise RuntimeError(
                        f"state in {self.describe()} has schema {version}, newer than this "
                        f"coordinator ({SCHEMA_VERSION}); refusing to touch it"
                    )
                if version == str(SCHEMA_VERSION):
                    return
            self._txn([_put(key, _dumps({"value": str(SCHEMA_VERSION)}))])

    @staticmethod
    def _meta_value(raw: bytes) -> str | None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        value = doc.get("value") if isinstance(doc, dict) else None
        return value if isinstance(value, str) else None

    def _assemble(
        self, kv: epb.KeyValue, parts: dict[bytes, list[bytes]], used: set[bytes]
    ) -> bytes:
        """The whole value of `kv` (its pieces joined when it points at pieces)."""
        raw = kv.value
        if not raw.startswith(b'{"' + _PARTS.encode()):
            return raw
        pointer = json.loads(raw)[_PARTS]
        pid, n = str(pointer["id"]).encode("ascii"), int(pointer["n"])
        group = self._parts_prefix(kv.key) + pid + b"/"
        used.add(group)
        pieces = parts.get(group, [])
        if len(pieces) != n:
            raise ValueError(f"{len(pieces)} of its {n} pieces are stored")
        value = b"".join(pieces)
        if len(value) != pointer["bytes"] or hashlib.sha256(value).hexdigest() != pointer["sha256"]:
            raise ValueError("its pieces do not add up to the value written")
        self._parted.add(kv.key)
        return value

    def load(self) -> StoredState:
        """Everything stored under the prefix. A record that is not a JSON object (or whose
        key is not one this store writes) is moved to `quarantine/` and logged; the rest loads."""
        with self._lock:
            self._parted = set()
            self._loaded = {}
            parts: dict[bytes, list[bytes]] = {}
            part_ids: list[bytes] = []
            for kv in self._range(self._root + b"parts/", PART_PAGE):
                head, _, _ = kv.key.rpartition(b"/")
                parts.setdefault(head + b"/", []).append(kv.value)
                part_ids.append(head.rpartition(b"/")[2])
            for pid in part_ids:
                if pid.isdigit():
                    self._part_id = max(self._part_id, int(pid))
            bad: list[tuple[bytes, str]] = []
            jobs: list[tuple[float, str, dict[str, Any]]] = []
            events: list[tuple[int, dict[str, Any]]] = []
            nodes: list[tuple[str, dict[str, Any]]] = []
            meta: dict[str, str] = {}
            jobs_root = self._root + b"jobs/"
            events_root = self._root + b"events/"
            nodes_root = self._root + b"nodes/"
            meta_root = self._root + b"meta/"
            used_parts: set[bytes] = set()
            for section in (meta_root, jobs_root, events_root, nodes_root):
                for kv in self._range(section):
                    rest = kv.key[len(section) :]
                    try:
                        doc = json.loads(self._assemble(kv, parts, used_parts))
                        if not isinstance(doc, dict):
                            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
                        if section is meta_root:
                            value_s = doc.get("value")
                            if not isinstance(value_s, str):
                                raise ValueError("a meta value must be {'value': string}")
                            meta[_unq(rest)] = value_s
                        elif section is jobs_root:
                            ts, data = doc.get("submitted_at"), doc.get("doc")
                            if not isinstance(ts, int | float) or not isinstance(data, dict):
                                raise ValueError("not a stored job (submitted_at, state, doc)")
                            job_id = _unq(rest)
                            jobs.append((float(ts), job_id, data))
                            self._loaded[("jobs", job_id)] = kv.key
                        elif section is events_root:
                            _, _, seq_s = rest.rpartition(b"/")
                            if not seq_s.isdigit() or len(seq_s) != 20:
                                raise ValueError("the key does not end in an event number")
                            seq = int(seq_s)
                            events.append((seq, doc))
                            self._loaded[("events", seq)] = kv.key
                        else:
                            name = _unq(rest)
                            nodes.append((name, doc))
                            self._loaded[("nodes", name)] = kv.key
                    except (ValueError, KeyError, TypeError, RecursionError) as exc:
                        # RecursionError: JSON nested deeper than the parser goes.
                        bad.append((kv.key, f"not readable: {exc}"))
            orphans = set(parts) - used_parts
        if bad:
            self._quarantine_keys(bad)
        if orphans:
            # Pieces of a write that never got its pointer (a crash between two txns).
            with self._lock:
                self._commit([_delete(p, _range_end(p)) for p in sorted(orphans)])
        jobs.sort(key=lambda j: j[0])
        events.sort(key=lambda e: e[0])
        nodes.sort(key=lambda n: n[0])
        return StoredState(
            jobs=[d for _, _, d in jobs],
            events=[d for _, d in events],
            nodes=[d for _, d in nodes],
            meta=meta,
            job_keys=[j for _, j, _ in jobs],
            event_keys=[s for s, _ in events],
            node_keys=[n for n, _ in nodes],
        )

    def quarantine(self, rows: Iterable[tuple[str, Any, str]]) -> None:
        """Move records (table, key as `load` returned it, why) aside into `quarantine/`."""
        found: list[tuple[bytes, str]] = []
        for table, key, why in rows:
            etcd_key = self._loaded.get((table, key))
            if etcd_key is None and table in ("jobs", "nodes"):
                etcd_key = self._key(table, str(key))
            if etcd_key is None:
                logger.error(
                    "cannot quarantine the %s record %s: not loaded", table, str(key)[:200]
                )
                continue
            found.append((etcd_key, why))
        self._quarantine_keys(found)

    def _quarantine_keys(self, rows: list[tuple[bytes, str]]) -> None:
        with self._lock:
            for i, (key, why) in enumerate(rows):
                kv = self._get(key)
                raw = kv.value if kv is not None else b""
                source, _, rest = key[len(self._root) :].partition(b"/")
                logger.error(
                    "moving a bad %s record (%s) aside to %squarantine/: %s",
                    source.decode("ascii", "replace"),
                    _unq(rest)[:200],
                    self._root.decode("ascii"),
                    why[:500],
                )
                entry = {
                    "source": source.decode("ascii", "replace"),
                    "key": _unq(rest)[:1000],
                    "data": raw[:QUARANTINE_DATA_BYTES].decode("utf-8", "replace"),
                    "error": why[:4000],
                    "at": time.time(),
                }
                qkey = self._root + b"quarantine/" + f"{time.time_ns():020d}-{i}".encode()
                self._txn([_put(qkey, _dumps(entry)), *self._forget_ops(key)])

    def save(
        self,
        jobs: Iterable[tuple[str, float, str, dict[str, Any]]],
        events: Iterable[tuple[int, str, dict[str, Any]]],
        nodes: Iterable[tuple[str, dict[str, Any]]] | None = None,
        meta: dict[str, str] | None = None,
        forget_jobs: Iterable[str] = (),
        forget_nodes: Iterable[str] = (),
        cut_events: Iterable[tuple[str, int, int]] = (),
    ) -> None:
        """Write jobs, events, nodes and meta values and delete forgotten jobs (with their
        events), nodes and cut event ranges; returns once every txn is committed."""
        gone_jobs = set(forget_jobs)
        cuts: dict[str, list[tuple[int, int]]] = {}
        for job_id, after, before in cut_events:
            cuts.setdefault(job_id, []).append((after, before))

        def deleted(job_id: str, seq: int) -> bool:
            # etcd refuses a txn that writes a key twice; a put the same batch deletes is moot.
            return job_id in gone_jobs or any(a < seq < b for a, b in cuts.get(job_id, ()))

        by_job: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for seq, job_id, doc in events:
            if not deleted(job_id, seq):
                by_job.setdefault(job_id, []).append((seq, doc))
        with self._lock:
            early: list[epb.RequestOp] = []
            ops: list[epb.RequestOp] = []
            for name, value in (meta or {}).items():
                ops += self._put_value(self._key("meta", name), _dumps({"value": value}), early)
            job_rows = {jid: (ts, st, doc) for jid, ts, st, doc in jobs if jid not in gone_jobs}
            for job_id in sorted(set(job_rows) | set(by_job)):
                for seq, doc in by_job.get(job_id, ()):
                    ops += self._put_value(self._event_key(job_id, seq), _dumps(doc), early)
                if job_id in job_rows:
                    ts, st, doc = job_rows[job_id]
                    row = _dumps({"submitted_at": ts, "state": st, "doc": doc})
                    ops += self._put_value(self._key("jobs", job_id), row, early)
            gone_nodes = set(forget_nodes)
            for name, doc in nodes or ():
                if name in gone_nodes:
                    continue
                ops += self._put_value(self._key("nodes", name), _dumps(doc), early)
            for job_id, ranges in cuts.items():
                if job_id in gone_jobs:
                    continue
                for after, before in ranges:
                    if before - after > 1:
                        ops.append(
                            _delete(
                                self._event_key(job_id, after + 1), self._event_key(job_id, before)
                            )
                        )
            for job_id in sorted(gone_jobs):
                events_prefix = self._key("events", job_id) + b"/"
                ops.append(_delete(events_prefix, _range_end(events_prefix)))
                ops += self._forget_ops(self._key("jobs", job_id))
            for name in sorted(gone_nodes):
                ops += self._forget_ops(self._key("nodes", name))
            parted = set(self._parted)
            try:
                self._commit(early + ops)
            except BaseException:
                # Not known to be written: a retry writes (and deletes) every piece again.
                self._parted = parted | self._parted
                raise

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels = []
