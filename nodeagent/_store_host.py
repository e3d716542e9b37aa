"""The agent's end of a round's c10d store host: bind its port, start it, hear from it, stop it.

`StoreHost.start` binds MASTER_ADDR:MASTER_PORT in the agent (so a port taken meanwhile is a clear
error before any worker starts), hands the listening socket to the `_c10d_store.py` process and
closes its own copy; it does not wait for torch to be imported there, which runs in parallel with
the workers' own imports. The host is in its own session, dies with the agent (PR_SET_PDEATHSIG,
and EOF on its stdin), is recorded in the pid file like a worker, and is stopped by the worker
group after the round's workers. The agent never imports torch.

A warm host (`WarmStoreHost`) waits for a later round with torch imported: spawned in
``--standby`` mode, or forked from the job's zygote (`WarmStoreHost.forked`), which imported the
job's preload (torch) already; either way it has the same stdin, status pipe, log and hand-off
channel, and the fork dies with its zygote, which dies with the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Awaitable, Callable
from typing import IO, Any

from nodeagent._launch import StoreHostLaunch
from nodeagent._process import AGENT_PID_ENV, RealProcess
from nodeagent._reaper import PidRegistry
from nodeagent._zygote import ForkedProcess

__all__ = ["StoreHost", "StoreHostError", "WarmStoreHost", "listen_for", "warm_key"]

logger = logging.getLogger(__name__)

_MAX_STATUS_BYTES = 4096


class StoreHostError(Exception):
    """The store's port cannot be listened on: the round cannot have its store."""


_AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]


def _numeric(addr: str, port: int) -> _AddrInfo | None:
    """The address of a numeric host, found without any lookup (None: it is a name)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        return None
    return infos[0] if infos else None


def _listen(addr: str, port: int, info: _AddrInfo | None = None) -> socket.socket:
    if info is None:
        info = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    family, kind, proto, _, sockaddr = info
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


def _cannot_listen(launch: StoreHostLaunch, e: OSError) -> StoreHostError:
    return StoreHostError(
        f"cannot listen on MASTER_ADDR:MASTER_PORT {launch.addr}:{launch.port} "
        f"for the c10d store: {e.strerror or e}"
    )


async def listen_for(launch: StoreHostLaunch) -> socket.socket:
    """The store's listening socket, bound before the workers start (so a port taken meanwhile
    is a clear error before any of them runs); `StoreHostError` when it cannot be. A numeric
    MASTER_ADDR is bound at once; a name is looked up in a thread, never on the event loop."""
    try:
        info = _numeric(launch.addr, launch.port)
        if info is None:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(launch.addr, launch.port, type=socket.SOCK_STREAM)
            info = infos[0]
        return _listen(launch.addr, launch.port, info)
    except OSError as e:
        raise _cannot_listen(launch, e) from e


class WarmStoreHost:
    """A store host that imported torch and waits for a round (`StoreHost.start(warm=...)`).

    Started with the job's store-host argv, env (no round variables) and cwd; its stderr goes to
    `log_path` (the log of the round that started it). The round's MASTER_ADDR/PORT and the
    listening socket reach it over a unix socket pair whose other end only the agent holds.
    """

    def __init__(
        self,
        key: tuple[object, ...],
        process: RealProcess | ForkedProcess,
        stdin: IO[bytes] | None,
        status_fd: int | None,
        channel: socket.socket | None,
    ) -> None:
        self.key = key
        self.process = process
        self.stdin = stdin
        self.status_fd = status_fd
        self.channel = channel

    @classmethod
    def start(
        cls, launch: StoreHostLaunch, *, registry: PidRegistry | None = None
    ) -> WarmStoreHost:
        """From the event-loop thread; OSError when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            log: IO[bytes] | int = open(launch.log_path, "ab")  # noqa: SIM115 - closed below
        except OSError:
            log = subprocess.DEVNULL
        # No round yet, and no job: what the hand-off brings is not in its env before then.
        env = {k: v for k, v in launch.env.items() if k not in _HANDED_ENV}
        try:
            process, stdin, status_fd = _spawn(
                launch, env, ["--standby"], theirs.fileno(), log, registry, launch.env
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(warm_key(launch), process, stdin, status_fd, ours)

    @classmethod
    async def forked(
        cls,
        launch: StoreHostLaunch,
        fork: Callable[[list[int]], Awaitable[ForkedProcess]],
        *,
        registry: PidRegistry | None = None,
    ) -> WarmStoreHost:
        """A warm host forked by the job's zygote (`Zygote.fork_store`), which imported torch
        already: the same stdin, status pipe, log and channel as `start` gives a spawned one.
        The zygote's env is the job's, as a warm host's is. OSError when it cannot be forked."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            log = os.open(launch.log_path, flags, 0o600)
        except OSError:
            log = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            process = await fork([stdin_r, status_w, log, theirs.fileno()])
        except BaseException:
            ours.close()
            os.close(stdin_w)
            os.close(status_r)
            raise
        finally:
            for fd in (stdin_r, status_w, log):
                os.close(fd)
            theirs.close()
        if registry is not None:
            registry.add(process.pid, job_id=launch.env.get("GELASTIC_JOB_ID", ""))
        stdin = os.fdopen(stdin_w, "wb", buffering=0)
        return cls(warm_key(launch), process, stdin, status_r, ours)

    def alive(self) -> bool:
        return self.process.is_alive() and self.channel is not None

    def discard(self) -> None:
        """Let it go: EOF on its stdin and its channel (it exits), SIGKILL for good measure."""
        for f in (self.stdin, self.channel):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.stdin = self.channel = None
        if self.status_fd is not None:
            os.close(self.status_fd)
            self.status_fd = None
        self.process.send_signal_group(signal.SIGKILL)


_ROUND_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GELASTIC_ROUND", "GELASTIC_NODE"}
)


_HANDED_ENV = _ROUND_ENV | {"GELASTIC_JOB_ID"}
"""What a warm host is handed with its round: the rest of its env must be the round's already."""


def _spawn(
    launch: StoreHostLaunch,
    env: dict[str, str],
    options: list[str],
    fd: int,
    log: IO[bytes] | int,
    registry: PidRegistry | None,
    job_env: dict[str, str],
) -> tuple[RealProcess, IO[bytes] | None, int | None]:
    """Start a store host process (its own session, `fd` inherited, stderr to `log`, which is
    closed here); its process, stdin and status pipe. Recorded in `registry` like a worker."""
    parent = os.getpid()
    env[AGENT_PID_ENV] = str(parent)
    try:
        popen = subprocess.Popen(
            [*launch.argv, str(parent), *options, str(fd)],
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
        if not isinstance(log, int):
            log.close()
    process = RealProcess(popen, asyncio.get_running_loop())
    status_fd, _ = process.take_pipes()
    stdin, popen.stdin = popen.stdin, None
    if registry is not None:
        registry.add(popen.pid, job_id=job_env.get("GELASTIC_JOB_ID", ""))
    return process, stdin, status_fd


def warm_key(launch: StoreHostLaunch) -> tuple[object, ...]:
    """What a warm host must share with a round's launch to serve it (a later job of the same
    spec included: the job's id comes with the hand-off)."""
    env = tuple(sorted((k, v) for k, v in launch.env.items() if k not in _HANDED_ENV))
    return (launch.argv, launch.cwd, env)


class StoreHost:
    """A running store host process for one round (see the module docstring)."""

    def __init__(
        self,
        launch: StoreHostLaunch,
        process: RealProcess | ForkedProcess,
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
        cls,
        launch: StoreHostLaunch,
        *,
        ctx: str,
        registry: PidRegistry | None = None,
        warm: WarmStoreHost | None = None,
        sock: socket.socket | None = None,
    ) -> StoreHost:
        """Listen on the store's port (unless given `sock`, from `listen_for`, which this
        takes over) and start the host; from the event-loop thread.

        With `warm` (alive, started for the same argv, cwd and job env) that host gets the
        socket and the round's address instead of a new process being started.
        Raises `StoreHostError` when the port cannot be listened on, OSError when the program
        or cwd cannot be used (the workers, which use the same, then fail to start as well).
        """
        if sock is None:
            try:
                sock = _listen(launch.addr, launch.port)
            except OSError as e:
                if warm is not None:
                    warm.discard()
                raise _cannot_listen(launch, e) from e
        if warm is not None:
            host = cls._adopt(launch, sock, warm, ctx, registry)
            if host is not None:
                return host
        try:
            log: IO[bytes] | int = open(launch.log_path, "ab")  # noqa: SIM115 - closed below
        except OSError:
            logger.warning("%s cannot open %s; store host stderr is dropped", ctx, launch.log_path)
            log = subprocess.DEVNULL
        try:
            process, stdin, status_fd = _spawn(
                launch, dict(launch.env), [], sock.fileno(), log, registry, launch.env
            )
        finally:
            # The host holds the socket now (or nobody does): the agent must not keep the port.
            sock.close()
        logger.info(
            "%s started the c10d store host pid %d for %s:%d",
            ctx,
            process.pid,
            launch.addr,
            launch.port,
        )
        return cls(launch, process, stdin, status_fd, ctx, registry)

    @classmethod
    def _adopt(
        cls,
        launch: StoreHostLaunch,
        sock: socket.socket,
        warm: WarmStoreHost,
        ctx: str,
        registry: PidRegistry | None,
    ) -> StoreHost | None:
        if not warm.alive() or warm.key != warm_key(launch) or warm.channel is None:
            warm.discard()
            return None
        env = {k: launch.env[k] for k in _HANDED_ENV if k in launch.env}
        try:
            socket.send_fds(warm.channel, [json.dumps(env).encode("utf-8")], [sock.fileno()])
        except OSError as e:
            logger.warning("%s the warm store host cannot take the round (%s)", ctx, e)
            warm.discard()
            return None  # the caller starts a cold host on the same socket
        sock.close()  # the warm host holds it now
        warm.channel.close()
        warm.channel = None
        logger.info(
            "%s the warm c10d store host pid %d serves %s:%d",
            ctx,
            warm.process.pid,
            launch.addr,
            launch.port,
        )
        return cls(launch, warm.process, warm.stdin, warm.status_fd, ctx, registry)

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
