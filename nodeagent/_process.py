"""Spawning and stopping worker processes: the only place in the agent that forks.

Each worker runs in its own session (so its process group can be signalled as a unit), dies
with the agent (PR_SET_PDEATHSIG), and has its stdout/stderr on pipes the agent reads. Exits are
detected through a pidfd on the event loop, never by polling. `ProcessHandle` is the small
surface supervision needs, so it can be tested with fakes.

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
from typing import Protocol

from nodeagent._launch import BOOTSTRAP_PATH, WorkerLaunch

__all__ = ["KILL_WAIT_S", "ProcessHandle", "RealProcess", "spawn"]

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long to wait after SIGKILL before a process is reported as unkillable (D state)."""

_PR_SET_PDEATHSIG = 1
AGENT_PID_ENV = "GELASTIC_AGENT_PID"
"""Set for every worker: the pid the worker must die with."""
PDEATHSIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pdeathsig.py")


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


class RealProcess:
    """A spawned worker process (a `ProcessHandle`)."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._loop = loop
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        self._terminating: asyncio.Task[bool] | None = None
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
        self._exited.set_result(rc)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal_group(self, sig: int) -> None:
        if self._exited.done():
            return
        try:
            os.killpg(self._popen.pid, sig)
        except ProcessLookupError:
            # The worker moved itself out of its group; signal the leader alone.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._popen.pid, sig)

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


def spawn(launch: WorkerLaunch) -> RealProcess:
    """Start one worker; raises OSError when the program or cwd cannot be used.

    No Python runs in the child between fork and exec (a `preexec_fn` in a process with threads
    can deadlock or crash there). Python workers arm the parent-death signal in the bootstrap;
    any other program is started through the small `_pdeathsig.py` exec stub.

    Must be called from the event-loop thread (see the module docstring).
    """
    loop = asyncio.get_running_loop()
    parent = os.getpid()
    env = dict(launch.env)
    env[AGENT_PID_ENV] = str(parent)
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
        start_new_session=True,
    )
    return RealProcess(popen, loop)


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
