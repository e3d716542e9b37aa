"""The sentinel: kills every process of an agent's workers the moment the agent dies.

``python -S -I _sentinel.py FD TOKEN``, started by the agent at boot in a session of its own.
FD is the read end of a pipe whose write end only the agent holds, so the sentinel learns of the
agent's death, however it died (SIGKILL included), from EOF on a blocking read: no polling.

PR_SET_PDEATHSIG kills a worker with its agent, but not what the worker started (DataLoader
workers, a tokenizer server, a shell pipeline). Those are found two ways:

- by **session**: every worker is a session leader, and its children inherit the session unless
  they call setsid. A session id cannot be handed to a new process while any member still has
  it, and a process whose pid equals the sid but whose start time differs is a stranger, so
  matching is exact.
- by **mark**: the agent puts ``GELASTIC_WORKER_MARK=<TOKEN>.<n>`` (TOKEN is new for every agent
  incarnation) into each worker's environment; children inherit it even across setsid. It is
  read from ``/proc/<pid>/environ``.

Only a process that both leaves the session and scrubs its environment escapes.

The agent writes one line per event: ``+ PID START_TICKS MARK`` when a worker starts and
``- PID`` when it has exited; on ``-`` the sentinel sweeps that worker's session and mark, so
leftovers of an exited worker do not linger while the agent lives. On EOF it sweeps every
session it knows and every mark of TOKEN, then exits. A sweep scans ``/proc``, SIGKILLs what
matches (through a pidfd, so a reused pid is never hit) and scans again until nothing matches,
for at most `SWEEP_BUDGET_S`.

It ignores SIGTERM, SIGINT and SIGHUP and exits on its own once the agent is gone.
Standalone and worker-side: standard library only, nothing of gelastic.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping

MARK_ENV = "GELASTIC_WORKER_MARK"
"""Set in every worker's environment: ``<agent token>.<worker number>``."""
SWEEP_BUDGET_S = 5.0
"""How long one sweep keeps killing and rescanning before it gives up (D-state processes)."""
PROC = "/proc"

# Plain classes rather than dataclasses: the sentinel lives as long as its agent on every host,
# and dataclasses (with inspect and re) would add a third to its memory.


class ProcInfo:
    """What a sweep needs to know about one process, from ``/proc/<pid>``."""

    __slots__ = ("mark", "pid", "sid", "start_ticks", "state")

    def __init__(self, pid: int, sid: int, start_ticks: int, state: str, mark: str | None) -> None:
        self.pid = pid
        self.sid = sid
        self.start_ticks = start_ticks
        """Start time in clock ticks since boot (field 22 of stat); with the pid, an identity."""
        self.state = state
        self.mark = mark
        """The value of `MARK_ENV` in its environment; None when absent or unreadable."""

    def _key(self) -> tuple[int, int, int, str, str | None]:
        return (self.pid, self.sid, self.start_ticks, self.state, self.mark)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcInfo) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"ProcInfo(pid={self.pid}, sid={self.sid}, start_ticks={self.start_ticks}, "
            f"state={self.state!r}, mark={self.mark!r})"
        )


class Targets:
    """What to kill: members of these sessions, and processes carrying these marks."""

    __slots__ = ("mark_prefix", "marks", "sessions")

    def __init__(
        self, sessions: Mapping[int, int], *, marks: Collection[str] = (), mark_prefix: str = ""
    ) -> None:
        self.sessions = sessions
        """{session id (= the worker's pid): the worker's start ticks}."""
        self.marks = marks
        self.mark_prefix = mark_prefix
        """Also every mark that starts with this ("" = none): all of one agent's workers."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Targets)
            and dict(self.sessions) == dict(other.sessions)
            and sorted(self.marks) == sorted(other.marks)
            and self.mark_prefix == other.mark_prefix
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Targets({dict(self.sessions)!r}, marks={list(self.marks)!r}, mark_prefix={self.mark_prefix!r})"


def read_stat(pid: int, proc: str = PROC) -> tuple[int, int, str] | None:
    """(session id, start ticks, state) of `pid`; None when it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces and parentheses.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[3]), int(fields[19]), fields[0].decode("ascii", "replace")
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int, proc: str = PROC) -> int | None:
    """The start time of `pid` in clock ticks since boot; None when it is gone."""
    stat = read_stat(pid, proc)
    return None if stat is None else stat[1]


def read_mark(pid: int, proc: str = PROC) -> str | None:
    """The value of `MARK_ENV` in the environment `pid` was started with."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:  # gone, or another user's process
        return None
    key = MARK_ENV.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode("ascii", "replace")
    return None


def scan(proc: str = PROC) -> Iterator[ProcInfo]:
    """Every live (not zombie) process but this one, as `ProcInfo`."""
    me = os.getpid()
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        stat = read_stat(pid, proc)
        if stat is None or stat[2] in ("Z", "X"):
            continue
        yield ProcInfo(pid, stat[0], stat[1], stat[2], read_mark(pid, proc))


def select_victims(procs: Collection[ProcInfo], targets: Targets) -> list[ProcInfo]:
    """The processes of `procs` that `targets` names (pure)."""
    by_pid = {p.pid: p for p in procs}
    # A live process that holds a session's number but started at another time is a stranger
    # that got the pid after the session ended: that session id is no longer ours.
    sessions = {
        sid: ticks
        for sid, ticks in targets.sessions.items()
        if sid not in by_pid or by_pid[sid].start_ticks == ticks
    }
    return [p for p in procs if _in_session(p, sessions) or _marked(p, targets)]


def _in_session(p: ProcInfo, sessions: Mapping[int, int]) -> bool:
    # Not older than the session's leader: a process from before the worker is never its child.
    return p.sid in sessions and p.start_ticks >= sessions[p.sid]


def _marked(p: ProcInfo, targets: Targets) -> bool:
    if p.mark is None:
        return False
    if p.mark in targets.marks:
        return True
    return bool(targets.mark_prefix) and p.mark.startswith(targets.mark_prefix)


def kill(p: ProcInfo, proc: str = PROC) -> bool:
    """SIGKILL `p` if it is still the process that was scanned; True when signalled."""
    try:
        fd = os.pidfd_open(p.pid)
    except ProcessLookupError:
        return False
    except OSError:
        fd = -1  # no pidfds (kernel < 5.3): check, then kill by pid
    try:
        # Through a pidfd the check and the signal are about one process, even if the pid is
        # reused meanwhile.
        if start_ticks(p.pid, proc) != p.start_ticks:
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(p.pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def sweep(
    targets: Targets,
    *,
    proc: str = PROC,
    budget: float = SWEEP_BUDGET_S,
    killer: Callable[[ProcInfo], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[int]:
    """Kill what `targets` names, rescanning until nothing is left or `budget` s have passed.

    Returns the pids signalled (once each). A process forked while a sweep runs is caught by the
    next scan, and the sweep goes on until a scan comes back empty.
    """
    do_kill = killer if killer is not None else (lambda p: kill(p, proc))
    signalled: dict[int, None] = {}
    deadline = clock() + budget
    pause = 0.001
    while True:
        victims = select_victims(list(scan(proc)), targets)
        if not victims:
            return list(signalled)
        for p in victims:
            if do_kill(p):
                signalled.setdefault(p.pid, None)
        if clock() >= deadline:
            _say(
                f"{len(victims)} process(es) still alive after SIGKILL: "
                f"{sorted(p.pid for p in victims)[:20]}"
            )
            return list(signalled)
        # A killed process takes a moment to exit; do not spin on the scan meanwhile.
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class Watch:
    """The sentinel's state: the agent's live workers, fed by the agent's lines (pure)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.workers: dict[int, tuple[int, str]] = {}
        """{pid: (start ticks, mark)} of the workers the agent runs."""

    def feed(self, line: str) -> Targets | None:
        """Apply one line of the agent's; the sweep it asks for, if any."""
        parts = line.split()
        if len(parts) == 4 and parts[0] == "+" and parts[1].isdigit() and parts[2].isdigit():
            self.workers[int(parts[1])] = (int(parts[2]), parts[3])
            return None
        if len(parts) == 2 and parts[0] == "-" and parts[1].isdigit():
            entry = self.workers.pop(int(parts[1]), None)
            if entry is None:
                return None
            return Targets({int(parts[1]): entry[0]}, marks=(entry[1],))
        if line.strip():
            _say(f"ignoring a malformed line from the agent: {line.strip()!r}")
        return None

    def final(self) -> Targets:
        """Everything the agent ever started and that is still there."""
        return Targets(
            {pid: ticks for pid, (ticks, _) in self.workers.items()},
            marks=[mark for _, mark in self.workers.values()],
            mark_prefix=f"{self.token}.",
        )


def _merge(batch: list[Targets]) -> Targets:
    sessions: dict[int, int] = {}
    marks: list[str] = []
    for t in batch:
        sessions.update(t.sessions)
        marks.extend(t.marks)
    return Targets(sessions, marks=marks)


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"gelastic sentinel {os.getpid()}: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # the agent's stderr may be gone with it
        pass


def _drain(fd: int) -> bytes:
    """What is already written to `fd`, without blocking: one sweep for a whole stopped group."""
    out = b""
    os.set_blocking(fd, False)
    try:
        while True:
            try:
                more = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not more:
                break  # EOF: the next blocking read sees it too
            out += more
    finally:
        os.set_blocking(fd, True)
    return out


def run(fd: int, token: str, proc: str = PROC) -> None:
    """Follow the agent's lines on `fd` until EOF, then kill everything of its workers."""
    watch = Watch(token)
    buf = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        buf += data
        buf += _drain(fd)
        *lines, rest = buf.split(b"\n")
        buf = rest
        batch = [t for t in (watch.feed(ln.decode("ascii", "replace")) for ln in lines) if t]
        if batch:
            targets = _merge(batch)
            # The exited leaders are zombies or gone, so only what they left is found.
            killed = sweep(targets, proc=proc)
            if killed:
                _say(
                    f"killed {len(killed)} process(es) left behind by worker(s) "
                    f"{sorted(targets.sessions)[:20]}: {killed[:20]}"
                )
    killed = sweep(watch.final(), proc=proc)
    if killed:
        _say(f"the agent is gone; killed {len(killed)} process(es) of its workers: {killed[:20]}")


def main() -> None:
    if len(sys.argv) != 3 or not sys.argv[1].isdigit() or not sys.argv[2]:
        sys.stderr.write("usage: _sentinel.py FD TOKEN\n")
        os._exit(2)
    # In a session of its own already, so terminal signals meant for the agent are not ours; and
    # a SIGTERM sent to "everything of the agent" (pkill -f nodeagent) must not take the sentinel
    # first: the agent's exit is what ends it.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    run(int(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
