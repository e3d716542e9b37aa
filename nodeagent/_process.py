"""Spawning and stopping worker processes: the only place in the agent that forks.

Each worker runs in its own session (so its process group can be signalled as a unit), dies
with the agent (PR_SET_PDEATHSIG), and has its stdout/stderr on pipes the agent reads. Exits are
detected through a pidfd on the event loop, never by polling. `ProcessHandle` is the small
surface supervision needs, so it can be tested with fakes.

What a worker starts dies with the agent too: `Sentinel` is the agent's end of the sentinel
process (`nodeagent._sentinel`), which holds the read end of a pipe only the agent can write.
`spawn` tells it of every worker (pid, start time, and the `GELASTIC_WORKER_MARK` it puts in the
worker's env) and of every exit; the sentinel kills the worker's session and marked processes
when the worker exits and, on EOF, when the agent dies, SIGKILL included. The worker's pid is
still the worker's own: nothing is interposed between the agent and the worker.

Spawn from the event-loop thread: PR_SET_PDEATHSIG fires when the *thread* that forked the
child exits, so a short-lived executor thread would kill its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Protocol

from nodeagent._launch import BOOTSTRAP_PATH, StandbyLaunch, WorkerLaunch
from nodeagent._sentinel import MARK_ENV, start_ticks

__all__ = [
    "KILL_WAIT_S",
    "GroupTermination",
    "ProcessHandle",
    "RealProcess",
    "Sentinel",
    "current_sentinel",
    "spawn",
]

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long to wait after SIGKILL before a process is reported as unkillable (D state)."""

_PR_SET_PDEATHSIG = 1
AGENT_PID_ENV = "GELASTIC_AGENT_PID"
"""Set for every worker: the pid the worker must die with."""
PDEATHSIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pdeathsig.py")
SENTINEL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sentinel.py")
SENTINEL_RESTART_S = 1.0
"""Pause before a sentinel that died is started again (so a broken one cannot spin)."""


class ProcessHandle(Protocol):
    """What supervision needs from a running worker process."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None:
        """None while running; negative = killed by that signal."""
        ...

    def is_alive(self) -> bool: ...

    async def wait(self) -> int:
        """The exit code once the process has exited (negative = signal)."""
        ...

    def send_signal_group(self, sig: int) -> None:
        """Signal the worker's whole process group; a no-op once it has exited."""
        ...

    async def terminate(self, grace: float) -> bool:
        """SIGTERM the group, SIGKILL after `grace`; False if it would not die (D state)."""
        ...

    def take_pipes(self) -> tuple[int | None, int | None]:
        """The read ends of stdout and stderr; the caller owns (and closes) them."""
        ...


class GroupTermination:
    """Signalling, waiting and `terminate` (SIGTERM to its group, `grace` seconds, then
    SIGKILL) for a process handle whose exit resolves `_exited`; shared by spawned
    (`RealProcess`) and forked workers."""

    _exited: asyncio.Future[int]
    _terminating: asyncio.Task[bool] | None
    signals_sent: set[int]

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def _reaped(self) -> bool:
        """Whether the pid may no longer be the worker's (it was reaped, or may be soon)."""
        raise NotImplementedError

    def _signal_alone(self, sig: int) -> None:
        """Signal the worker itself, not its group (ProcessLookupError: it is gone)."""
        raise NotImplementedError

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal_group(self, sig: int) -> None:
        if self._reaped():
            return
        self.signals_sent.add(sig)
        try:
            # Unreaped, so the group id is still the worker's.
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            # The worker moved itself out of its group: the worker alone.
            with contextlib.suppress(ProcessLookupError):
                self._signal_alone(sig)

    async def terminate(self, grace: float) -> bool:
        if self._terminating is None:
            self._terminating = asyncio.ensure_future(self._terminate(grace))
        return await asyncio.shield(self._terminating)

    async def _terminate(self, grace: float) -> bool:
        if self._exited.done():
            return True
        if grace > 0:
            self.send_signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._exited), grace)
                return True
        self.send_signal_group(signal.SIGKILL)
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), KILL_WAIT_S)
        except TimeoutError:
            logger.error(
                "pid %s did not exit %.0f s after SIGKILL (uninterruptible sleep?); abandoning it",
                self.pid,
                KILL_WAIT_S,
            )
            return False
        return True


class RealProcess(GroupTermination):
    """A spawned worker process (a `ProcessHandle`)."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        loop: asyncio.AbstractEventLoop,
        sentinel: Sentinel | None = None,
    ) -> None:
        self._popen = popen
        self._loop = loop
        self._sentinel = sentinel
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        self._terminating: asyncio.Task[bool] | None = None
        self.signals_sent: set[int] = set()
        """Signals the agent sent this worker: a death by another's signal is no stop of ours."""
        self._watch()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def is_alive(self) -> bool:
        return self._popen.returncode is None

    def _watch(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self._popen.pid)
        except (AttributeError, OSError) as e:
            # Kernels before 5.3: a dedicated thread blocks in waitpid for this one child.
            logger.debug("pidfd_open unavailable (%s); waiting for pid %s in a thread", e, self.pid)
            threading.Thread(
                target=self._wait_in_thread, name=f"wait-{self.pid}", daemon=True
            ).start()
            return
        self._loop.add_reader(self._pidfd, self._on_pidfd)

    def _wait_in_thread(self) -> None:
        # The leader is still unreaped after waitid(WNOWAIT), so its pid (and group id)
        # cannot be reused while the strays are killed.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, self._popen.pid, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._reap)

    def _on_pidfd(self) -> None:
        self._reap()

    def _reap(self) -> None:
        if self._exited.done():
            return
        # The leader is a zombie now: its pid cannot be reused yet, so the group id is still
        # ours. Kill whatever it left behind in its group before reaping it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        rc = self._popen.poll()
        if rc is None:
            return
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._sentinel is not None:
            # Whatever left the group (setsid, its own process groups) goes now, not with the
            # agent.
            self._sentinel.forget(self._popen.pid)
        self._exited.set_result(rc)

    def _reaped(self) -> bool:
        return self._exited.done()

    def _signal_alone(self, sig: int) -> None:
        # Kernels before 5.3: by pid, still unreaped.
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, sig)
        else:
            os.kill(self._popen.pid, sig)

    def take_pipes(self) -> tuple[int | None, int | None]:
        fds: list[int | None] = []
        for name in ("stdout", "stderr"):
            f = getattr(self._popen, name)
            if f is None:
                fds.append(None)
                continue
            # dup + close: Popen must not later close a descriptor number we reuse.
            fds.append(os.dup(f.fileno()))
            f.close()
            setattr(self._popen, name, None)
        return fds[0], fds[1]

    def close(self) -> None:
        """Stop watching (the process is not signalled); for agent shutdown."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._terminating is not None and not self._terminating.done():
            self._terminating.cancel()


def spawn(
    launch: WorkerLaunch | StandbyLaunch,
    *,
    sentinel: Sentinel | None = None,
    pass_fds: tuple[int, ...] = (),
) -> RealProcess:
    """Start one worker; raises OSError when the program or cwd cannot be used.

    No Python runs in the child between fork and exec (a `preexec_fn` in a process with threads
    can deadlock or crash there). Python workers arm the parent-death signal in the bootstrap;
    any other program is started through the small `_pdeathsig.py` exec stub. The worker is
    watched by `sentinel` (default: the agent's, `current_sentinel()`), so what it starts dies
    with it and with the agent.

    Must be called from the event-loop thread (see the module docstring).
    """
    loop = asyncio.get_running_loop()
    parent = os.getpid()
    guard = sentinel if sentinel is not None else current_sentinel()
    env = dict(launch.env)
    env[AGENT_PID_ENV] = str(parent)
    mark = guard.next_mark() if guard is not None else None
    if mark is not None:
        env[MARK_ENV] = mark
    else:
        env.pop(MARK_ENV, None)  # never another agent's mark
    argv = list(launch.argv)
    if BOOTSTRAP_PATH not in argv:
        program = _resolve(argv[0], env, launch.cwd)
        argv = [sys.executable, "-S", "-I", PDEATHSIG_PATH, str(parent), "--", program, *argv[1:]]
    popen = subprocess.Popen(
        argv,
        env=env,
        cwd=launch.cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
        pass_fds=pass_fds,
        start_new_session=True,
    )
    if guard is not None and mark is not None:
        # The child is unreaped until RealProcess reaps it, so its /proc entry is there.
        guard.watch(popen.pid, start_ticks(popen.pid) or 0, mark)
    return RealProcess(popen, loop, guard)


def _resolve(program: str, env: dict[str, str], cwd: str | None) -> str:
    """The program's path, as exec would find it; FileNotFoundError/PermissionError otherwise.

    Checked here so a missing program is a clear spawn failure, not an exit code of the stub.
    """
    if os.sep in program:
        path = program if os.path.isabs(program) or not cwd else os.path.join(cwd, program)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such file or directory", program)
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise PermissionError(13, "Permission denied", program)
        return program
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(2, "No such file or directory", program)
    return found


_current: Sentinel | None = None


def current_sentinel() -> Sentinel | None:
    """The running sentinel of this process's agent, if one was started."""
    return _current


class Sentinel:
    """The agent's end of its sentinel process: start at agent start, stop at agent stop.

    Started, it becomes `current_sentinel()` (one agent per process), so every `spawn` is
    watched. Lines go down a non-blocking pipe, buffered while the pipe is full, so the event
    loop never blocks on the sentinel. A sentinel that dies is started again (after
    `SENTINEL_RESTART_S`) and told every live worker. Call from the event-loop thread.
    """

    def __init__(self, *, python: str = sys.executable, token: str | None = None) -> None:
        self.token = token or uuid.uuid4().hex
        """New per agent incarnation: the prefix of every mark this agent hands out."""
        self._python = python
        self._seq = 0
        self._watched: dict[int, tuple[int, str]] = {}
        # Workers that exited while no sentinel ran: the next one still sweeps what they left.
        self._unswept: dict[int, tuple[int, str]] = {}
        self._popen: subprocess.Popen[bytes] | None = None
        self._wfd: int | None = None
        self._pidfd: int | None = None
        self._pending = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart: asyncio.TimerHandle | None = None
        self._started_at = 0.0
        self._closing = False

    @property
    def pid(self) -> int | None:
        """The sentinel process's pid while it runs."""
        return self._popen.pid if self._popen is not None else None

    @property
    def watched(self) -> dict[int, int]:
        """{pid: start ticks} of the workers the sentinel is told of and that have not exited."""
        return {pid: ticks for pid, (ticks, _) in self._watched.items()}

    def start(self) -> None:
        """Start the sentinel process; raises OSError when it cannot be started."""
        global _current
        self._loop = asyncio.get_running_loop()
        self._closing = False
        self._launch()
        _current = self

    def _launch(self) -> None:
        rfd, wfd = os.pipe()
        try:
            popen = subprocess.Popen(
                [self._python, "-S", "-I", SENTINEL_PATH, str(rfd), self.token],
                stdin=subprocess.DEVNULL,
                cwd="/",
                env={k: v for k, v in os.environ.items() if k != MARK_ENV},
                # Only the agent may hold the write end: EOF must mean the agent is gone.
                close_fds=True,
                pass_fds=(rfd,),
                # Out of the agent's group: a signal to the agent's group (a terminal's ^C, a
                # supervisor's group kill) must leave it alive to clean up.
                start_new_session=True,
            )
        except BaseException:
            os.close(wfd)
            raise
        finally:
            os.close(rfd)
        os.set_blocking(wfd, False)
        self._popen, self._wfd = popen, wfd
        self._started_at = time.monotonic()
        self._pending = bytearray()
        for pid, (ticks, mark) in self._watched.items():
            self._pending += f"+ {pid} {ticks} {mark}\n".encode()
        for pid, (ticks, mark) in self._unswept.items():
            self._pending += f"+ {pid} {ticks} {mark}\n- {pid}\n".encode()
        self._unswept.clear()
        self._flush()
        assert self._loop is not None
        try:
            self._pidfd = os.pidfd_open(popen.pid)
            self._loop.add_reader(self._pidfd, self._on_exit)
        except (AttributeError, OSError):
            self._pidfd = None  # its death is then noticed on the next write (EPIPE)
        logger.debug("sentinel pid %d started (token %s)", popen.pid, self.token)

    @property
    def backlog(self) -> int:
        """Bytes written to the sentinel's pipe but not yet taken by it (the pipe is full)."""
        return len(self._pending)

    @property
    def mark_prefix(self) -> str:
        """What every mark of this agent's workers starts with."""
        return f"{self.token}."

    def next_mark(self) -> str:
        """A new worker's `GELASTIC_WORKER_MARK` value."""
        self._seq += 1
        return f"{self.mark_prefix}{self._seq}"

    def watch(self, pid: int, ticks: int, mark: str) -> None:
        """A worker started: kill its session and mark with the agent."""
        self._watched[pid] = (ticks, mark)
        self._send(f"+ {pid} {ticks} {mark}\n")

    def forget(self, pid: int) -> None:
        """A worker exited (reaped or not): kill what it left behind now."""
        entry = self._watched.pop(pid, None)
        if entry is None:
            return
        if self._wfd is None and not self._closing:
            self._unswept[pid] = entry
            return
        self._send(f"- {pid}\n")

    def _send(self, line: str) -> None:
        if self._wfd is None:
            return  # stopped, or between a death and the restart: _launch replays the workers
        self._pending += line.encode()
        self._flush()

    def _flush(self) -> None:
        if self._wfd is None or self._loop is None:
            return
        try:
            while self._pending:
                n = os.write(self._wfd, self._pending)
                del self._pending[:n]
        except BlockingIOError:
            self._loop.add_writer(self._wfd, self._on_writable)
            return
        except BrokenPipeError:
            self._on_exit()
            return
        self._loop.remove_writer(self._wfd)

    def _on_writable(self) -> None:
        self._flush()

    def _on_exit(self) -> None:
        popen = self._popen
        self._close_ends()
        if popen is None or self._closing:
            return
        rc = popen.poll()
        if rc is None:
            # The pipe broke but the process is still there: it no longer reads; replace it.
            with contextlib.suppress(ProcessLookupError):
                popen.kill()
            rc = popen.wait()
        delay = max(0.0, SENTINEL_RESTART_S - (time.monotonic() - self._started_at))
        logger.error(
            "sentinel pid %d exited with %s; starting a new one in %.1f s",
            popen.pid,
            rc,
            delay,
        )
        assert self._loop is not None
        self._restart = self._loop.call_later(delay, self._relaunch)

    def _relaunch(self) -> None:
        self._restart = None
        if self._closing:
            return
        try:
            self._launch()
        except OSError:
            logger.exception("cannot start the sentinel again")
            assert self._loop is not None
            self._restart = self._loop.call_later(SENTINEL_RESTART_S, self._relaunch)

    def _close_ends(self) -> None:
        if self._pidfd is not None and self._loop is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
        self._pidfd = None
        if self._wfd is not None:
            if self._loop is not None:
                self._loop.remove_writer(self._wfd)
            os.close(self._wfd)
        self._wfd = None
        self._popen = None

    async def stop(self, timeout: float = 10.0) -> None:
        """Close the pipe (the sentinel sweeps once more and exits) and wait for it; idempotent.

        Workers still watched are killed by that sweep: workers never outlive their agent.
        """
        global _current
        self._closing = True
        if _current is self:
            _current = None
        if self._restart is not None:
            self._restart.cancel()
            self._restart = None
        popen = self._popen
        if self._wfd is not None and self._pending:
            # Last lines first, blocking: a worker's start must not be lost at shutdown.
            with contextlib.suppress(OSError):
                os.set_blocking(self._wfd, True)
                os.write(self._wfd, self._pending)
        self._close_ends()
        if popen is None:
            return
        try:
            await asyncio.to_thread(popen.wait, timeout)
        except subprocess.TimeoutExpired:
            logger.error("sentinel pid %d did not exit %.0f s after EOF", popen.pid, timeout)
