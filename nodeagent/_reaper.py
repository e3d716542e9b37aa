"""Workers must never outlive their agent: the record of live workers, and its cleanup.

PR_SET_PDEATHSIG kills a worker when its agent dies, and the sentinel (`nodeagent._sentinel`)
kills what the worker started. In case the sentinel died too (the OOM killer, a `kill -9` of
both), the agent also keeps a small JSON file of its live worker pids (with their psutil
create_time and /proc start ticks), of this boot's id and of the prefix of its workers'
`GELASTIC_WORKER_MARK`, under its state dir (0600, in a 0700 dir of ours); on the next start
`reap_previous` kills every process still carrying that mark.

The file is input like any other: it is believed only when it is a regular file of ours that
no one else may write, from this boot (`/proc/sys/kernel/random/boot_id`); a bad record is
reported and skipped, never fatal; and nothing is signalled for being named in it. A process is
killed only if it carries the recorded mark (so the agent started it), is ours, and is not
pid 1, through a pidfd after checking its start time (so a pid reused meanwhile is never hit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nodeagent._dirs import private_dir
from nodeagent._sentinel import PROC, SWEEP_BUDGET_S, ProcInfo, kill, scan, start_ticks

__all__ = [
    "PidRegistry",
    "RecordedWorker",
    "boot_id",
    "reap_previous",
    "record_workers",
    "select_previous",
    "worker_sessions",
]

logger = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_PID_FILE_BYTES = 4 * 1024 * 1024
MAX_RECORDS = 65536
MAX_PID = 1 << 22
"""The kernel's largest pid_max."""
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_MARK_PREFIX = re.compile(r"[0-9a-f]{32}\.")


@dataclass(frozen=True)
class RecordedWorker:
    pid: int
    create_time: float
    job_id: str = ""
    global_rank: int = -1
    start_ticks: int = 0
    """Start time in clock ticks since boot (0 = not recorded): with the pid, its session."""


class PidRegistry:
    """The agent's file of live worker pids; rewritten atomically on every change.

    With `write_behind` the rewrite runs in a thread, off the event loop that starts the
    workers: the changes made while one write is under way are written together by the next,
    so a round of N workers costs one or two writes, not N, and none on the loop. `flushed`
    waits until the file says what the registry holds (the agent awaits it as it stops).
    Without a running loop the file is written at once, as without `write_behind`.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, mark_prefix: str = "", write_behind: bool = False
    ) -> None:
        self.path = Path(path)
        self.mark_prefix = mark_prefix
        """Every worker of this agent carries a `GELASTIC_WORKER_MARK` starting with this."""
        self._workers: dict[int, RecordedWorker] = {}
        self._write_behind = write_behind
        self._dirty = False
        self._writer: asyncio.Task[None] | None = None

    @property
    def workers(self) -> dict[int, RecordedWorker]:
        return dict(self._workers)

    def add(self, pid: int, *, job_id: str = "", global_rank: int = -1) -> None:
        import psutil  # with the first worker: an idle agent does without it

        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # already gone: nothing to reap later
        ticks = start_ticks(pid) or 0
        self._workers[pid] = RecordedWorker(pid, create_time, job_id, global_rank, ticks)
        self._changed()

    def remove(self, pid: int) -> None:
        if self._workers.pop(pid, None) is not None:
            self._changed()

    def _changed(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        if self._write_behind:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        if loop is None:
            self._write(list(self._workers.values()))
            return
        self._dirty = True
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_changes(), name="pid-file")

    async def _write_changes(self) -> None:
        # Bounded: each pass writes what the registry held when it began; a pass comes only
        # for changes made during the previous one.
        while self._dirty:
            self._dirty = False
            try:
                await asyncio.to_thread(self._write, list(self._workers.values()))
            except Exception:
                logger.exception("cannot write the worker pid file %s", self.path)

    async def flushed(self) -> None:
        """Wait for the writes under way (the file then says what the registry holds)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    def _write(self, workers: list[RecordedWorker]) -> None:
        try:
            _write(self.path, workers, self.mark_prefix)
        except OSError:
            logger.exception("cannot write the worker pid file %s", self.path)


def _write(path: Path, workers: Iterable[RecordedWorker], mark_prefix: str = "") -> None:
    data = {
        "agent_pid": os.getpid(),
        "boot_id": boot_id(),
        "mark_prefix": mark_prefix,
        "workers": [
            {
                "pid": w.pid,
                "create_time": w.create_time,
                "job_id": w.job_id,
                "rank": w.global_rank,
                "start_ticks": w.start_ticks,
            }
            for w in workers
        ],
    }
    if not path.parent.is_dir():
        private_dir(path.parent)
    # A temp name of our own making (O_EXCL, 0600): a symlink planted at a fixed name would
    # have this write land in whatever file it points to.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record_workers(
    path: str | os.PathLike[str], pids: Iterable[int], *, mark_prefix: str = ""
) -> None:
    """Replace the pid file at `path` with these live worker pids; raises OSError.

    Pids that are already gone are left out (there is nothing to reap later).
    """
    import psutil  # with the first worker: an idle agent does without it

    workers = []
    for pid in pids:
        try:
            workers.append(
                RecordedWorker(
                    pid, psutil.Process(pid).create_time(), start_ticks=start_ticks(pid) or 0
                )
            )
        except psutil.Error:
            continue
    _write(Path(path), workers, mark_prefix)


def boot_id() -> str:
    """This boot's random id ("" when unknown): pids and start ticks mean nothing across boots."""
    try:
        with open(BOOT_ID_PATH, "rb") as f:
            value = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return value if _BOOT_ID.fullmatch(value) else ""


def _read_pid_file(path: Path) -> bytes | None:
    """The pid file's bytes, if it is a regular file of ours that no one else may write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        logger.warning("ignoring the worker pid file %s: %s", path, e.strerror or e)
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"owned by uid {st.st_uid}, not by this agent's uid {os.geteuid()}"
        elif st.st_mode & 0o022:
            why = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
        elif st.st_size > MAX_PID_FILE_BYTES:
            why = f"larger than {MAX_PID_FILE_BYTES} bytes"
        if why:
            logger.warning("ignoring the worker pid file %s: %s", path, why)
            return None
        return f.read(MAX_PID_FILE_BYTES + 1)[:MAX_PID_FILE_BYTES]


def _record(item: object) -> RecordedWorker:
    """One worker record; raises ValueError saying what is wrong with it."""
    if not isinstance(item, dict):
        raise ValueError("not an object")
    pid, ticks = item.get("pid"), item.get("start_ticks", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 < pid <= MAX_PID:
        raise ValueError(f"pid {str(pid)[:40]!r} is not one of a worker")
    if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
        raise ValueError(f"start_ticks {str(ticks)[:40]!r} is not a tick count")
    create_time = item.get("create_time", 0.0)
    if isinstance(create_time, bool) or not isinstance(create_time, int | float):
        raise ValueError(f"create_time {str(create_time)[:40]!r} is not a time")
    job_id, rank = item.get("job_id", ""), item.get("rank", -1)
    return RecordedWorker(
        pid,
        float(create_time),
        job_id[:128] if isinstance(job_id, str) else "",
        rank if isinstance(rank, int) and not isinstance(rank, bool) else -1,
        ticks,
    )


def _load(path: Path) -> tuple[list[RecordedWorker], str]:
    """The recorded workers and the mark prefix of the agent that wrote `path`.

    Nothing in the file is trusted that does not hold up: a file of another boot, of another
    user or writable by others is ignored whole, a bad record on its own; all is reported and
    none of it stops the agent from starting.
    """
    raw = _read_pid_file(path)
    if raw is None:
        return [], ""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        logger.warning("ignoring unreadable worker pid file %s: %s", path, e)
        return [], ""
    if not isinstance(data, dict):
        logger.warning("ignoring worker pid file %s: not a JSON object", path)
        return [], ""
    recorded_boot, here = data.get("boot_id"), boot_id()
    if not here or recorded_boot != here:
        logger.warning(
            "ignoring worker pid file %s: written in another boot (%s), its pids are not ours",
            path,
            str(recorded_boot)[:40] if recorded_boot else "no boot id recorded",
        )
        return [], ""
    prefix = data.get("mark_prefix", "")
    # A bare prefix ("", ".") would match every marked process of every agent.
    if not isinstance(prefix, str) or not _MARK_PREFIX.fullmatch(prefix):
        logger.warning("worker pid file %s has no usable worker mark: nothing is reaped", path)
        prefix = ""
    items = data.get("workers", [])
    if not isinstance(items, list):
        logger.warning("ignoring the workers of pid file %s: not a list", path)
        items = []
    out = []
    for i, item in enumerate(items[:MAX_RECORDS]):
        try:
            out.append(_record(item))
        except ValueError as e:
            logger.warning("ignoring record %d of worker pid file %s: %s", i, path, e)
    return out, prefix


def _marked(p: ProcInfo, mark_prefix: str) -> bool:
    return bool(mark_prefix) and p.mark is not None and p.mark.startswith(mark_prefix)


def worker_sessions(
    procs: Iterable[ProcInfo], recorded: Iterable[RecordedWorker], mark_prefix: str
) -> dict[int, int]:
    """{session id: leader start ticks} of the recorded workers whose session is still ours (pure).

    A recorded session counts only if a live member of it carries the mark: a record alone,
    pid and start time included, never makes a session ours. A live process holding the
    session's number but with another start time is a stranger that got the pid later.
    """
    procs = list(procs)
    by_pid = {p.pid: p for p in procs}
    out = {}
    for rec in recorded:
        sid, ticks = rec.pid, rec.start_ticks
        if not ticks or (sid in by_pid and by_pid[sid].start_ticks != ticks):
            continue
        if any(p.sid == sid and p.start_ticks >= ticks and _marked(p, mark_prefix) for p in procs):
            out[sid] = ticks
    return out


def select_previous(
    procs: Iterable[ProcInfo], mark_prefix: str, sessions: dict[int, int], *, me: int
) -> list[ProcInfo]:
    """The processes of `procs` to kill for a previous agent (pure): those carrying its mark,
    and the members of its workers' sessions (`worker_sessions`) that are not older than the
    worker (a child that scrubbed its environment but stayed in the session). Never pid 1 or
    `me`.
    """
    if not mark_prefix:
        return []
    return [
        p
        for p in procs
        if p.pid > 1
        and p.pid != me
        and (_marked(p, mark_prefix) or (p.sid in sessions and p.start_ticks >= sessions[p.sid]))
    ]


def _owned_by_me(pid: int, proc: str) -> bool:
    """Whether `pid` runs as our uid (real or effective), from its status: unlike the owner of
    /proc/<pid>, that is right for a process that made itself non-dumpable too."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            status = f.read(16384)
    except OSError:
        return False
    for line in status.split(b"\n"):
        if line.startswith(b"Uid:"):
            uids = line.split()[1:3]
            return str(os.geteuid()).encode() in uids
    return False


def reap_previous(
    path: str | os.PathLike[str], *, proc: str = PROC, budget: float = SWEEP_BUDGET_S
) -> list[int]:
    """Kill what is left of the workers a previous agent recorded at `path`; returns pids killed.

    Only a file from this boot, owned by us and writable by no one else, is believed. What is
    killed is every process of our uid that still carries the previous agent's
    `GELASTIC_WORKER_MARK` (the workers, and whatever they started, setsid or not), and what
    is left in a recorded worker's session that a marked member vouches for; each through a
    pidfd after checking its start time, so a pid reused meanwhile is never hit. A recorded pid
    that is alive without that mark is a stranger and is left alone. Kills and rescans until
    nothing is left, for at most `budget` s. The file is removed afterwards.
    """
    p = Path(path)
    me = os.getpid()
    recorded, mark_prefix = _load(p)
    killed: dict[int, None] = {}
    deadline = time.monotonic() + budget
    pause = 0.001
    sessions: dict[int, int] | None = None
    while mark_prefix:
        procs = list(scan(proc))
        first = sessions is None
        if sessions is None:
            # Judged once, while the marked members that vouch for a session are alive.
            sessions = worker_sessions(procs, recorded, mark_prefix)
        victims = [
            v
            for v in select_previous(procs, mark_prefix, sessions, me=me)
            if _owned_by_me(v.pid, proc)
        ]
        if first:
            _report(recorded, victims, proc)
        if not victims:
            break
        for v in victims:
            if kill(v, proc) and v.pid not in killed:
                logger.warning(
                    "killed pid %d, left behind by the workers of a previous agent", v.pid
                )
                killed[v.pid] = None
        if time.monotonic() >= deadline:
            logger.error(
                "%d process(es) of a previous agent's workers still alive after SIGKILL: %s",
                len(victims),
                sorted(v.pid for v in victims)[:20],
            )
            break
        time.sleep(pause)  # a killed process takes a moment to exit
        pause = min(pause * 2, 0.05)
    if not mark_prefix:
        _report(recorded, [], proc)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    return list(killed)


def _report(recorded: list[RecordedWorker], victims: list[ProcInfo], proc: str) -> None:
    marked = {v.pid for v in victims}
    for rec in recorded:
        if rec.pid in marked:
            logger.warning(
                "killing worker pid %d (job %s rank %d) left by a previous agent",
                rec.pid,
                rec.job_id,
                rec.global_rank,
            )
        elif start_ticks(rec.pid, proc) is not None:
            logger.warning(
                "recorded worker pid %d is alive but does not carry the previous agent's "
                "worker mark: not ours, left alone",
                rec.pid,
            )
