"""Workers must never outlive their agent: the record of live workers, and its cleanup.

PR_SET_PDEATHSIG kills a worker when its agent dies, and the sentinel (`nodeagent._sentinel`)
kills what the worker started. In case the sentinel died too (the OOM killer, a `kill -9` of
both), the agent also keeps a small JSON file of its live worker pids (with their psutil
create_time and /proc start ticks, so a reused pid is never mistaken for a worker) and of the
prefix of its workers' `GELASTIC_WORKER_MARK`, under its state dir; on the next start
`reap_previous` kills the process groups and sessions that are still there, and every process
carrying that mark.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from nodeagent._sentinel import Targets, start_ticks, sweep

__all__ = ["PidRegistry", "RecordedWorker", "reap_previous", "record_workers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordedWorker:
    pid: int
    create_time: float
    job_id: str = ""
    global_rank: int = -1
    start_ticks: int = 0
    """Start time in clock ticks since boot (0 = not recorded): with the pid, its session."""


class PidRegistry:
    """The agent's file of live worker pids; rewritten atomically on every change."""

    def __init__(self, path: str | os.PathLike[str], *, mark_prefix: str = "") -> None:
        self.path = Path(path)
        self.mark_prefix = mark_prefix
        """Every worker of this agent carries a `GELASTIC_WORKER_MARK` starting with this."""
        self._workers: dict[int, RecordedWorker] = {}

    @property
    def workers(self) -> dict[int, RecordedWorker]:
        return dict(self._workers)

    def add(self, pid: int, *, job_id: str = "", global_rank: int = -1) -> None:
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # already gone: nothing to reap later
        ticks = start_ticks(pid) or 0
        self._workers[pid] = RecordedWorker(pid, create_time, job_id, global_rank, ticks)
        self._write()

    def remove(self, pid: int) -> None:
        if self._workers.pop(pid, None) is not None:
            self._write()

    def _write(self) -> None:
        try:
            _write(self.path, self._workers.values(), self.mark_prefix)
        except OSError:
            logger.exception("cannot write the worker pid file %s", self.path)


def _write(path: Path, workers: Iterable[RecordedWorker], mark_prefix: str = "") -> None:
    data = {
        "agent_pid": os.getpid(),
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
    tmp = path.with_name(f"{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def record_workers(path: str | os.PathLike[str], pids: Iterable[int]) -> None:
    """Replace the pid file at `path` with these live worker pids; raises OSError.

    Pids that are already gone are left out (there is nothing to reap later).
    """
    workers = []
    for pid in pids:
        try:
            workers.append(RecordedWorker(pid, psutil.Process(pid).create_time()))
        except psutil.Error:
            continue
    _write(Path(path), workers)


def _load(path: Path) -> tuple[list[RecordedWorker], str]:
    """The recorded workers and the mark prefix of the agent that wrote `path`."""
    try:
        data = json.loads(path.read_text())
        out = []
        for item in data.get("workers", []):
            out.append(
                RecordedWorker(
                    int(item["pid"]),
                    float(item["create_time"]),
                    str(item.get("job_id", "")),
                    int(item.get("rank", -1)),
                    int(item.get("start_ticks", 0)),
                )
            )
        prefix = data.get("mark_prefix", "")
        # A bare prefix ("", ".") would match every marked process of every agent.
        return out, prefix if isinstance(prefix, str) and len(prefix) > 8 else ""
    except FileNotFoundError:
        return [], ""
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("ignoring unreadable worker pid file %s: %s", path, e)
        return [], ""


def _group_members(pgid: int, not_before: float) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if (
                os.getpgid(proc.pid) == pgid
                and proc.create_time() >= not_before
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def reap_previous(path: str | os.PathLike[str]) -> list[int]:
    """Kill what is left of the workers a previous agent recorded at `path`; returns pids killed.

    A worker whose pid is alive with the recorded create_time gets its process group killed.
    When the worker itself is gone, the members of its old process group are killed: a group id
    cannot be reused while any member lives, and members are checked to be younger than the
    worker. Then every process left in a recorded worker's session, or carrying the previous
    agent's worker mark (one that left the session with setsid), is killed the way the sentinel
    does. The file is removed afterwards.
    """
    p = Path(path)
    killed: list[int] = []
    me = os.getpid()
    recorded, mark_prefix = _load(p)
    for rec in recorded:
        if rec.pid == me:
            continue
        try:
            leader = psutil.Process(rec.pid)
            # A zombie is already dead; only its parent's reaping is pending.
            leader_alive = (
                abs(leader.create_time() - rec.create_time) < 1e-3
                and leader.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            leader_alive = False
        if leader_alive:
            logger.warning(
                "killing worker pid %d (job %s rank %d) left by a previous agent",
                rec.pid,
                rec.job_id,
                rec.global_rank,
            )
            try:
                os.killpg(rec.pid, signal.SIGKILL)
            except ProcessLookupError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec.pid, signal.SIGKILL)
            killed.append(rec.pid)
            continue
        if psutil.pid_exists(rec.pid):
            continue  # the pid now belongs to an unrelated process: its group is not ours
        for proc in _group_members(rec.pid, rec.create_time):
            logger.warning(
                "killing pid %d, left in the process group of worker %d of a previous agent",
                proc.pid,
                rec.pid,
            )
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                proc.kill()
            killed.append(proc.pid)
    targets = Targets(
        {rec.pid: rec.start_ticks for rec in recorded if rec.start_ticks and rec.pid != me},
        mark_prefix=mark_prefix,
    )
    if targets.sessions or targets.mark_prefix:
        for pid in sweep(targets):
            if pid not in killed:
                logger.warning("killed pid %d, left behind by the workers of a previous agent", pid)
                killed.append(pid)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    return killed
