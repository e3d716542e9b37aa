"""The coordinator's durable state in etcd v3: one key per job, event, node and meta value.

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

The calls themselves (members, failover, authentication, txns, leases) are `EtcdClient`'s
(`coordinator._etcd_client`); `EtcdStore` is an `EtcdClient` that knows the layout above.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

from coordinator._etcd_client import (
    CALL_TIMEOUT_S,
    EtcdClient,
    EtcdRefused,
    EtcdSettings,
    _delete,
    _put,
    _range_end,
)
from coordinator._etcd_client import MAX_TXN_OPS as MAX_TXN_OPS
from coordinator._store import (
    SCHEMA_VERSION,
    Fence,
    JobDoc,
    StoredState,
    StoreUnavailable,
    job_doc_text,
)
from protos.etcd import rpc_pb2 as epb

__all__ = ["SECTIONS", "EtcdRefused", "EtcdSettings", "EtcdStore", "parse_etcd_url"]

logger = logging.getLogger(__name__)

CONNECT_WAIT_S = 30.0
"""How long opening the store waits for etcd to answer before it gives up."""
PART_BYTES = 512 * 1024
"""A value larger than this is written in pieces of this size."""
MAX_VALUE_BYTES = 512 * 1024 * 1024
"""A value larger than this is refused: no job should ever need it."""
PART_PAGE = 8
MAX_ENDPOINTS = 16
QUARANTINE_DATA_BYTES = 256 * 1024
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}(/[A-Za-z0-9_.\-]{1,64}){0,7}")
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
_PARTS = "__parts__"
SECTIONS = frozenset({"meta", "jobs", "events", "nodes", "quarantine", "parts", "leader"})
"""The names directly under a store's prefix. A prefix with one of them as a part would nest
one store inside another's section (`x/jobs` inside the `jobs` of `x`): the outer one would
read the inner one's keys as its own records, and move them aside as bad ones."""


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


def _q(part: str) -> bytes:
    return urllib.parse.quote(part, safe="").encode("ascii")


def _unq(part: bytes) -> str:
    return urllib.parse.unquote(part.decode("ascii", errors="replace"))


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


class EtcdStore(EtcdClient):
    """A thread-safe handle on the coordinator's keys in etcd (see the module docstring)."""

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        call_timeout: float = CALL_TIMEOUT_S,
        connect_wait: float = CONNECT_WAIT_S,
    ) -> None:
        root = settings.prefix.encode("ascii") + b"/"
        super().__init__(settings, call_timeout=call_timeout)
        self._lock = threading.Lock()
        self._root = root
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

    # ---- the leader key (the election: coordinator/_leader.py) ------------------------

    def leader_key(self) -> bytes:
        return self._root + b"leader"

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
        jobs: Iterable[tuple[str, float, str, JobDoc]],
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
        for seq, job_id, event in events:
            if not deleted(job_id, seq):
                by_job.setdefault(job_id, []).append((seq, event))
        with self._lock:
            early: list[epb.RequestOp] = []
            ops: list[epb.RequestOp] = []
            for name, value in (meta or {}).items():
                ops += self._put_value(self._key("meta", name), _dumps({"value": value}), early)
            job_rows = {jid: (ts, st, doc) for jid, ts, st, doc in jobs if jid not in gone_jobs}
            for job_id in sorted(set(job_rows) | set(by_job)):
                for seq, event in by_job.get(job_id, ()):
                    ops += self._put_value(self._event_key(job_id, seq), _dumps(event), early)
                if job_id in job_rows:
                    ts, st, doc = job_rows[job_id]
                    # The document's text as it came (see JobDoc), in the row's own JSON.
                    head = _dumps({"submitted_at": ts, "state": st})[:-1]
                    row = head + b',"doc":' + job_doc_text(doc).encode("utf-8") + b"}"
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
