"""The coordinator's durable state: the store interface, and its SQLite implementation.

`StateStore` is what the service writes through; it never knows which store it has. Two
implementations keep one promise: `save` returns only once the write is committed, so callers
that must not answer before their write is durable (submit, cancel) wait for the flush.

- `Store`: one SQLite database (WAL) in the state directory, the default.
- `coordinator._store_etcd.EtcdStore`: keys under a prefix in an etcd v3 cluster, for a
  coordinator whose state must outlive its host.

Jobs are stored as one JSON document each (rewritten when the job changes), events are appended,
nodes are the registry as last seen. Writes are batched into one transaction. In SQLite the
members of a job's round are rows of their own (`members`), and a write of a `JobRecord` rewrites
only those that changed: a round of 10,000 nodes is most of its job's document.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "SCHEMA_VERSION",
    "Fence",
    "JobDoc",
    "JobRecord",
    "StateStore",
    "Store",
    "StoreFenced",
    "StoreUnavailable",
    "StoredState",
    "default_state_dir",
    "job_doc_text",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""The layout of the stored records (both stores)."""
SQLITE_SCHEMA_VERSION = 2
"""The SQLite database's tables: 2 added `members` (a job's round's members, see JobRecord);
a coordinator of 1 would read such a job with no members, so it refuses the file."""
MEMORY = ":memory:"
WAL_LIMIT_BYTES = 8 * 1024 * 1024
VACUUM_PAGES = 2048
KEEP_FREE_PAGES = 64
"""Free pages left in the file for the next writes to reuse."""


_TABLES = (
    ("jobs", "job_id", "submitted_at"),
    ("events", "seq", "seq"),
    ("nodes", "name", "name"),
)
"""(table, key column, load order) of the rows `load` reads."""


def default_state_dir() -> str:
    """A per-user data directory ($XDG_DATA_HOME/gelastic or ~/.local/share/gelastic)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "gelastic")


def _private_dir(path: Path) -> None:
    """Create the state dir 0700, or tighten one that exists, when it is this user's own."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if not st.st_mode & 0o077:
        return
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
        # Not ours to change (or a shared dir like /tmp): say so rather than chmod it.
        logger.warning(
            "state dir %s is open to other users (mode %o); the database in it is not",
            path,
            stat.S_IMODE(st.st_mode),
        )
        return
    os.chmod(path, 0o700)


def _private_file(path: str, *, create: bool = True) -> None:
    """Make `path` a 0600 regular file of this user's (created when `create`); never a symlink."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        return
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


MEMBERS_APART = "__members_apart__"
"""Key of a SQLite job row whose round's members are rows of the `members` table: their count."""


@dataclass(frozen=True)
class JobRecord:
    """A job's document as JSON text, its round's members apart: a job of 10,000 nodes is
    mostly them, and a burst of reports changes a few at a time (see coordinator._job_text).

    The document is `before` + the members' texts joined by commas + `after`; `changed` holds
    the indices of the members that changed since the record of the job the store last wrote
    (all of them for the first record of a process). A store writes the whole (`text`) or
    the head and the changed members (SQLite)."""

    before: str
    members: Sequence[str]
    after: str
    changed: frozenset[int]

    def text(self) -> str:
        return self.before + ",".join(self.members) + self.after

    def head(self) -> str:
        """The document with no members, saying how many there are apart."""
        return f'{self.before}{self.after[:-1]},"{MEMBERS_APART}":{len(self.members)}}}'


JobDoc = dict[str, Any] | str | JobRecord
"""A job's stored document: the object, its JSON text, or a `JobRecord`."""


def job_doc_text(doc: JobDoc) -> str:
    """The compact JSON text of a job's document."""
    if isinstance(doc, JobRecord):
        return doc.text()
    return doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))


@dataclass(frozen=True)
class StoredState:
    jobs: list[dict[str, Any]]
    events: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    meta: dict[str, str]
    """Small named values of the coordinator's own (e.g. how far event numbers are reserved)."""
    job_keys: list[str] = field(default_factory=list)
    event_keys: list[int] = field(default_factory=list)
    node_keys: list[str] = field(default_factory=list)
    """The row keys of `jobs`, `events` and `nodes`, in the same order (for `quarantine`)."""


@dataclass(frozen=True)
class Fence:
    """A condition every write is made on: the key still has this creation revision.

    A coordinator that leads holds a key whose creation revision is its term; a write guarded
    by it fails once another coordinator took over (the key was deleted and made again).
    """

    key: bytes
    create_revision: int


class StoreUnavailable(ConnectionError):
    """The store cannot be reached or did not answer in time; nothing is known to be written."""


class StoreFenced(Exception):
    """A guarded write was refused: the fence no longer holds (another coordinator leads)."""


class StateStore(Protocol):
    """What the coordinator writes its state through. Every method is thread-safe, blocking
    and bounded in time; the service calls `save` through `asyncio.to_thread`."""

    def describe(self) -> str:
        """Where the state lives, for messages (never a secret)."""
        ...

    def load(self) -> StoredState:
        """Everything stored; unreadable records are quarantined, not returned."""
        ...

    def quarantine(self, rows: Iterable[tuple[str, Any, str]]) -> None:
        """Move records (table, key from StoredState, why) aside where an operator can read them."""
        ...

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
        """Write a batch; returns only once it is committed, raises if it may not be. A job's
        document (`JobDoc`) comes as an object, as the JSON text of one, or as a `JobRecord`."""
        ...

    def set_fence(self, fence: Fence | None) -> None:
        """Make every later write conditional on `fence` (None: unconditional)."""
        ...

    def close(self) -> None: ...


class Store:
    """A thread-safe handle on the database; every method is one transaction."""

    def __init__(self, state_dir: str) -> None:
        if state_dir == MEMORY:
            self.path = MEMORY
        else:
            _private_dir(Path(state_dir))
            self.path = str(Path(state_dir) / "coordinator.sqlite3")
            _private_file(self.path)
        self._lock = threading.Lock()
        # The database holds every job's spec and env: only this user may read it. SQLite makes
        # the -wal and -shm files when WAL mode is first set, with the process umask.
        umask = os.umask(0o077)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
        finally:
            os.umask(umask)
        if self.path != MEMORY:
            for suffix in ("-wal", "-shm"):
                _private_file(self.path + suffix, create=False)
        # FULL: a write the client was told about survives a power cut, not only a crash.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        # The log file shrinks back after each checkpoint instead of staying at its peak.
        self._db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self._migrate()

    def describe(self) -> str:
        return f"SQLite database {self.path}"

    def set_fence(self, fence: Fence | None) -> None:
        # One writer by construction: the state dir is locked by the process that opened it.
        if fence is not None:
            raise ValueError("a SQLite store has one writer; it takes no fence")

    def _migrate(self) -> None:
        with self._lock:
            db = self._db
            if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                # Incremental: pages freed by retention go back to the file system (in steps,
                # see `delete`), so the file levels off. Switching an existing file needs a
                # VACUUM, once.
                db.execute("PRAGMA auto_vacuum=INCREMENTAL")
                db.execute("VACUUM")
            db.execute(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None and int(row[0]) > SQLITE_SCHEMA_VERSION:
                raise RuntimeError(
                    f"state in {self.path} has schema {row[0]}, newer than this coordinator "
                    f"({SQLITE_SCHEMA_VERSION}); refusing to touch it"
                )
            db.execute("BEGIN")
            db.execute(
                "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, submitted_at REAL NOT NULL,"
                " state TEXT NOT NULL, data TEXT NOT NULL)"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL,"
                " data TEXT NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq)")
            db.execute(
                "CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, data TEXT NOT NULL)"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS members (job_id TEXT NOT NULL, idx INTEGER NOT NULL,"
                " data TEXT NOT NULL, PRIMARY KEY (job_id, idx))"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS quarantine (id INTEGER PRIMARY KEY, source TEXT NOT NULL,"
                " key TEXT NOT NULL, data TEXT NOT NULL, error TEXT NOT NULL, at REAL NOT NULL)"
            )
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SQLITE_SCHEMA_VERSION),),
            )
            db.execute("COMMIT")

    def load(self) -> StoredState:
        """Everything stored. A row that is not a JSON object is moved to `quarantine` (and
        logged) instead of stopping the coordinator from starting."""
        with self._lock:
            db = self._db
            tables: dict[str, tuple[list[Any], list[dict[str, Any]]]] = {}
            bad: list[tuple[str, Any, str]] = []
            for table, key, order in _TABLES:
                keys: list[Any] = []
                docs: list[dict[str, Any]] = []
                for k, data in db.execute(f"SELECT {key}, data FROM {table} ORDER BY {order}"):
                    try:
                        doc = json.loads(data)
                        if not isinstance(doc, dict):
                            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
                    except (ValueError, RecursionError) as exc:
                        # RecursionError: JSON nested deeper than the parser goes.
                        bad.append((table, k, f"not readable: {exc}"))
                        continue
                    keys.append(k)
                    docs.append(doc)
                tables[table] = (keys, docs)
            members: dict[str, list[tuple[int, str]]] = {}
            for job_id, idx, data in db.execute(
                "SELECT job_id, idx, data FROM members ORDER BY job_id, idx"
            ):
                members.setdefault(job_id, []).append((idx, data))
            meta = {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta")}
        keys, docs = tables["jobs"]
        for i in reversed(range(len(docs))):
            why = _attach_members(docs[i], members.get(keys[i], []))
            if why:
                bad.append(("jobs", keys[i], why))
                del keys[i], docs[i]
        if bad:
            self.quarantine(bad)
        return StoredState(
            jobs=tables["jobs"][1],
            events=tables["events"][1],
            nodes=tables["nodes"][1],
            meta=meta,
            job_keys=tables["jobs"][0],
            event_keys=tables["events"][0],
            node_keys=tables["nodes"][0],
        )

    def quarantine(self, rows: Iterable[tuple[str, Any, str]]) -> None:
        """Move rows (table, key, why) aside into `quarantine`, where an operator can read them."""
        columns = {table: key for table, key, _ in _TABLES}
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                for table, key, why in rows:
                    column = columns[table]
                    logger.error(
                        "moving a bad %s row (%s=%s) aside to the quarantine table: %s",
                        table,
                        column,
                        str(key)[:200],
                        why[:500],
                    )
                    db.execute(
                        f"INSERT INTO quarantine (source, key, data, error, at) SELECT ?, ?, data, ?,"
                        f" strftime('%s','now') FROM {table} WHERE {column}=?",
                        (table, str(key), why[:4000], key),
                    )
                    db.execute(f"DELETE FROM {table} WHERE {column}=?", (key,))
                    if table == "jobs":
                        db.execute(
                            "INSERT INTO quarantine (source, key, data, error, at) SELECT"
                            " 'members', job_id || '/' || idx, data, ?, strftime('%s','now')"
                            " FROM members WHERE job_id=?",
                            (f"a member of job {str(key)[:200]}, set aside with it", key),
                        )
                        db.execute("DELETE FROM members WHERE job_id=?", (key,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

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
        """Write jobs (id, submitted_at, state, doc), events (seq, job id, doc), changed nodes
        and meta values, and delete forgotten jobs (with their events) and nodes, in one
        transaction."""
        gone_jobs = [(j,) for j in forget_jobs]
        gone_nodes = [(n,) for n in forget_nodes]
        cuts = list(cut_events)  # (job id, after seq, before seq), both ends kept
        job_rows: list[tuple[str, float, str, str]] = []
        member_rows: list[tuple[str, int, str]] = []
        member_counts: list[tuple[str, int]] = []
        for jid, ts, st, doc in jobs:
            if isinstance(doc, JobRecord):
                # The head, and only the members that changed: a big job's write stays small.
                job_rows.append((jid, ts, st, doc.head()))
                n = len(doc.members)
                member_rows += ((jid, i, doc.members[i]) for i in sorted(doc.changed) if i < n)
                member_counts.append((jid, n))
            else:
                job_rows.append((jid, ts, st, job_doc_text(doc)))
                member_counts.append((jid, 0))  # the whole document: no member rows
        event_rows = [
            (seq, jid, json.dumps(doc, separators=(",", ":"))) for seq, jid, doc in events
        ]
        node_rows = (
            [(name, json.dumps(doc, separators=(",", ":"))) for name, doc in nodes]
            if nodes is not None
            else None
        )
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.executemany(
                    "INSERT OR REPLACE INTO jobs (job_id, submitted_at, state, data) VALUES (?,?,?,?)",
                    job_rows,
                )
                db.executemany("DELETE FROM members WHERE job_id=? AND idx>=?", member_counts)
                db.executemany(
                    "INSERT OR REPLACE INTO members (job_id, idx, data) VALUES (?,?,?)",
                    member_rows,
                )
                db.executemany(
                    "INSERT OR REPLACE INTO events (seq, job_id, data) VALUES (?,?,?)", event_rows
                )
                if node_rows:
                    db.executemany(
                        "INSERT OR REPLACE INTO nodes (name, data) VALUES (?,?)", node_rows
                    )
                if meta:
                    db.executemany(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES (?,?)", meta.items()
                    )
                if cuts:
                    db.executemany("DELETE FROM events WHERE job_id=? AND seq>? AND seq<?", cuts)
                if gone_jobs:
                    db.executemany("DELETE FROM events WHERE job_id=?", gone_jobs)
                    db.executemany("DELETE FROM members WHERE job_id=?", gone_jobs)
                    db.executemany("DELETE FROM jobs WHERE job_id=?", gone_jobs)
                if gone_nodes:
                    db.executemany("DELETE FROM nodes WHERE name=?", gone_nodes)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            free = db.execute("PRAGMA freelist_count").fetchone()[0]
            if free > KEEP_FREE_PAGES:
                # Deleted jobs and rewritten documents free pages: give them back to the file
                # system a bounded step at a time, so a write never stalls long. Each step of
                # the statement frees one page, and executescript is what steps it to the end
                # (execute stops after the first step).
                db.executescript(f"PRAGMA incremental_vacuum({VACUUM_PAGES});")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _attach_members(doc: dict[str, Any], rows: list[tuple[int, str]]) -> str:
    """Put a job's member rows (index, text) back into its document; why they do not fit
    ("" when they do, or when its members are in the document itself)."""
    count = doc.pop(MEMBERS_APART, None)
    if count is None:
        return ""
    current = doc.get("current")
    if not isinstance(count, int) or not isinstance(current, dict):
        return "not readable: its members' count or its round is not what was written"
    if [i for i, _ in rows] != list(range(count)):
        return f"not readable: {count} members written apart, {len(rows)} found"
    try:
        current["members"] = [json.loads(data) for _, data in rows]
    except (ValueError, RecursionError) as exc:
        return f"not readable: a member: {exc}"
    return ""
