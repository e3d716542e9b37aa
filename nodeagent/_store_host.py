"""The agent's end of a round's c10d store host: bind its port, start it, hear from it, stop it.

`StoreHost.start` binds MASTER_ADDR:MASTER_PORT in the agent (so a port taken meanwhile is a clear
error before any worker starts), hands the listening socket to the `_c10d_store.py` process and
closes its own copy; it does not wait for torch to be imported there, which runs in parallel with
the workers' own imports. The host is in its own session, dies with the agent (PR_SET_PDEATHSIG,
and EOF on its stdin), is recorded in the pid file like a worker, and is stopped by the worker
group after the round's workers. The agent never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
from typing import IO

from nodeagent._launch import StoreHostLaunch
from nodeagent._process import AGENT_PID_ENV, RealProcess
from nodeagent._reaper import PidRegistry

__all__ = ["StoreHost", "StoreHostError"]

logger = logging.getLogger(__name__)

_MAX_STATUS_BYTES = 4096


class StoreHostError(Exception):
    """The store's port cannot be listened on: the round cannot have its store."""


def _listen(addr: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As TCPStore itself does: connections of an earlier round in TIME_WAIT do not block it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        # Every rank may connect before the host has imported torch: they wait in the backlog.
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class StoreHost:
    """A running store host process for one round (see the module docstring)."""

    def __init__(
        self,
        launch: StoreHostLaunch,
        process: RealProcess,
        stdin: IO[bytes] | None,
        status_fd: int | None,
        ctx: str,
        registry: PidRegistry | None,
    ) -> None:
        self.launch = launch
        self._process = process
        self._stdin = stdin
        self._status_fd = status_fd
        self._status = b""
        self._ctx = ctx
        self._registry = registry
        self._stopping = False
        self.state = "starting"
        """"starting", then "ready", "no-torch" or "exited"."""
        self.reason = ""
        """What the host said with "no-torch"."""
        if status_fd is not None:
            os.set_blocking(status_fd, False)
            asyncio.get_running_loop().add_reader(status_fd, self._on_status)

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(
        cls, launch: StoreHostLaunch, *, ctx: str, registry: PidRegistry | None = None
    ) -> StoreHost:
        """Listen on the store's port and start the host; from the event-loop thread.

        Raises `StoreHostError` when the port cannot be listened on, OSError when the program
        or cwd cannot be used (the workers, which use the same, then fail to start as well).
        """
        try:
            sock = _listen(launch.addr, launch.port)
        except OSError as e:
            raise StoreHostError(
                f"cannot listen on MASTER_ADDR:MASTER_PORT {launch.addr}:{launch.port} "
                f"for the c10d store: {e.strerror or e}"
            ) from e
        try:
            log: IO[bytes] | int = open(launch.log_path, "ab")  # noqa: SIM115 - closed below
        except OSError:
            logger.warning("%s cannot open %s; store host stderr is dropped", ctx, launch.log_path)
            log = subprocess.DEVNULL
        parent = os.getpid()
        env = dict(launch.env)
        env[AGENT_PID_ENV] = str(parent)
        try:
            fd = sock.fileno()
            popen = subprocess.Popen(
                [*launch.argv, str(parent), str(fd)],
                env=env,
                cwd=launch.cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                pass_fds=(fd,),
                close_fds=True,
                start_new_session=True,
            )
        finally:
            # The host holds the socket now (or nobody does): the agent must not keep the port.
            sock.close()
            if not isinstance(log, int):
                log.close()
        process = RealProcess(popen, asyncio.get_running_loop())
        status_fd, _ = process.take_pipes()
        stdin, popen.stdin = popen.stdin, None
        if registry is not None:
            registry.add(popen.pid, job_id=env.get("GELASTIC_JOB_ID", ""))
        logger.info(
            "%s started the c10d store host pid %d for %s:%d",
            ctx,
            popen.pid,
            launch.addr,
            launch.port,
        )
        return cls(launch, process, stdin, status_fd, ctx, registry)

    def _on_status(self) -> None:
        if self._status_fd is None:
            return
        try:
            data = os.read(self._status_fd, _MAX_STATUS_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_status()
            return
        self._status = (self._status + data)[-_MAX_STATUS_BYTES:]
        while b"\n" in self._status:
            line, self._status = self._status.split(b"\n", 1)
            self._heard(line.decode("utf-8", errors="replace").strip())

    def _heard(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "ready":
            self.state = "ready"
            logger.info(
                "%s c10d store serving at %s:%d (pid %d)",
                self._ctx,
                self.launch.addr,
                self.launch.port,
                self.pid,
            )
        elif word == "no-torch":
            self.state, self.reason = "no-torch", rest
            # Not a problem by itself: a job that cannot import torch has no use for a store.
            logger.info(
                "%s the job's python cannot import torch (%s): no c10d store at %s:%d",
                self._ctx,
                rest,
                self.launch.addr,
                self.launch.port,
            )

    def _close_status(self) -> None:
        if self._status_fd is not None:
            asyncio.get_running_loop().remove_reader(self._status_fd)
            os.close(self._status_fd)
            self._status_fd = None

    async def watch(self) -> int:
        """Wait for the host to exit; log it when it was not asked to. Returns the exit code."""
        rc = await self._process.wait()
        if self._registry is not None:
            self._registry.remove(self.pid)
        if not self._stopping and self.state != "no-torch":
            logger.error(
                "%s the c10d store host pid %d exited with %d while the round runs; see %s",
                self._ctx,
                self.pid,
                rc,
                self.launch.log_path,
            )
        self.state = "exited"
        return rc

    async def stop(self, grace: float) -> bool:
        """EOF on its stdin, SIGTERM, SIGKILL after `grace`; idempotent. False = would not die."""
        self._stopping = True
        if self._stdin is not None:
            with contextlib.suppress(OSError):
                self._stdin.close()
            self._stdin = None
        ok = await self._process.terminate(grace)
        self._close_status()
        if ok and self._registry is not None:
            self._registry.remove(self.pid)
        return ok

    def close(self) -> None:
        """Stop watching (the process is not signalled); for agent shutdown."""
        self._close_status()
        self._process.close()
