"""Zygotes: one interpreter per standby launch imports the job's preload once and forks workers.

A job with `preload` gets, on each agent that runs it, one zygote per standby launch (the key of
`nodeagent._standby`: interpreter, argv, cwd, the whole job env, the preload list): the bootstrap
in zygote mode (``--zygote FD --preload M...``, see `nodeagent._bootstrap._zygote`), spawned like
a worker (own session, parent-death signal, the agent's worker mark), which imports the modules
once, `gc.freeze()`s and then forks on request. Each fork is what a spawned standby is: it blocks
on its hand-off pipe and then runs the round's entrypoint as a cold worker would, with the
stdout/stderr pipes the agent passed (SCM_RIGHTS over an AF_UNIX SOCK_SEQPACKET socketpair only
the agent holds the other end of), stdin /dev/null, its own session, signal dispositions reset,
every other descriptor closed, and PR_SET_PDEATHSIG armed on the zygote (which dies with the
agent: a chain). Messages are JSON, at most `MAX_MESSAGE` bytes each way; nothing is unpickled.

**Exit status.** The agent is not a fork's parent, so the zygote reports it: it waits for its
forks (SIGCHLD), SIGKILLs what each left in its process group while the fork is still an
unreaped zombie (so the group id cannot have been reused), reaps it and sends the exit code.
The agent's `ForkedProcess` learns of the exit through a pidfd (which works for non-children)
and takes the code from the zygote's message; a zygote that is gone can report nothing, and its
forks, which die with it, are reported as killed by SIGKILL. This was chosen over making the
agent a child subreaper with double forks: the agent would then also reap orphans of everything
else it starts, and must never steal a status another wait (asyncio's, `subprocess`'s) owns.

**Marks.** The zygote carries the agent's worker mark of its own in its environment; each fork
gets a new mark in `os.environ` (so what it execs carries it) and is told to the sentinel with
that mark, while /proc/PID/environ of a fork still shows the zygote's. So a fork's exit sweeps
its session and its own mark, never a sibling (they share only the zygote's mark); the agent's
death sweeps every mark of the agent, the zygote's included; the zygote's exit sweeps the
zygote's mark, i.e. all of its forks, which is why `StandbyPool` retires a zygote only once its
last fork has exited (forks die with their zygote anyway).

A fork request is awaited, never waited for on the event loop: the zygote runs the job's code
(its preload, and whatever that registered to run at a fork), so its answer may take as long
as that code likes, and the agent's heartbeats must go on meanwhile. A zygote that does not
answer within `FORK_REPLY_S` forks no more (it is killed once its forks have exited); a fork it
makes for a request nobody awaits any more (timed out, or cancelled) finds its hand-off pipe
closed and exits 0 by itself. Call everything from the event-loop thread.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Coroutine
from typing import Any, TypeGuard

from nodeagent._launch import StandbyLaunch
from nodeagent._process import (
    GroupTermination,
    RealProcess,
    Sentinel,
    current_sentinel,
    spawn,
)
from nodeagent._sentinel import start_ticks

__all__ = ["FORK_REPLY_S", "MAX_MESSAGE", "ForkedProcess", "Zygote"]

logger = logging.getLogger(__name__)

MAX_MESSAGE = 16384
"""Largest message on a zygote's socket (kept in step with nodeagent._bootstrap)."""
FORK_REPLY_S = 10.0
"""How long a fork request waits for the zygote's answer."""
_MAX_LOG_READ = 65536
_MAX_EARLY_EXITS = 64


def _is_pid(value: object) -> TypeGuard[int]:
    """A pid a fork can have (Linux caps pid_max at 2**22)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 < value <= 1 << 22


def _is_exit_code(value: object) -> TypeGuard[int]:
    """An exit code (0-255) or a death by signal (-1 to -64), as the zygote reports them."""
    return isinstance(value, int) and not isinstance(value, bool) and -64 <= value <= 255


class ForkedProcess(GroupTermination):
    """A worker (or standby) forked by a zygote: a `ProcessHandle`."""

    def __init__(
        self,
        pid: int,
        pipes: tuple[int | None, int | None],
        loop: asyncio.AbstractEventLoop,
        sentinel: Sentinel | None,
        zygote_alive: bool = True,
    ) -> None:
        self._pid = pid
        self._loop = loop
        self._sentinel = sentinel
        self._pipes: tuple[int | None, int | None] = pipes
        self._returncode: int | None = None
        self._exited: asyncio.Future[int] = loop.create_future()
        self._terminating: asyncio.Task[bool] | None = None
        self._gone = False
        """The process has exited (its pidfd said so) but no status came yet."""
        self._zygote_alive = zygote_alive
        self.signals_sent: set[int] = set()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._gone = True  # already reaped by the zygote: its report is on the way
            return
        loop.add_reader(self._pidfd, self._on_pidfd)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def is_alive(self) -> bool:
        return self._returncode is None

    def _on_pidfd(self) -> None:
        self._close_pidfd()
        self._gone = True
        if not self._zygote_alive:
            self._finish(-signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def reported(self, code: int) -> None:
        """The zygote reaped this process: `code` is its exit code (negative: a signal)."""
        self._finish(code)

    def zygote_gone(self) -> None:
        """The zygote died: no status will come; the process dies with it (SIGKILL)."""
        self._zygote_alive = False
        if self._gone:
            self._finish(-signal.SIGKILL)

    def _finish(self, code: int) -> None:
        if self._exited.done():
            return
        self._close_pidfd()
        self._returncode = code
        if self._sentinel is not None:
            self._sentinel.forget(self._pid)
        self._exited.set_result(code)

    def _reaped(self) -> bool:
        # Once it has exited the zygote reaps it at any moment, and its pid and group id may be
        # another process's before the report arrives.
        return self._exited.done() or self._gone

    def _signal_alone(self, sig: int) -> None:
        # Not (yet) a group leader, or it left its group: by pidfd only (it is not our child).
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def take_pipes(self) -> tuple[int | None, int | None]:
        pipes, self._pipes = self._pipes, (None, None)
        return pipes

    def close(self) -> None:
        """Stop watching (the process is not signalled); for agent shutdown."""
        self._close_pidfd()
        for fd in self._pipes:
            if fd is not None:
                os.close(fd)
        self._pipes = (None, None)
        if self._terminating is not None and not self._terminating.done():
            self._terminating.cancel()


class Zygote:
    """The agent's end of one zygote process. Call from the event-loop thread."""

    def __init__(self, handle: RealProcess, sock: socket.socket, preload: tuple[str, ...]) -> None:
        self.handle = handle
        self.preload = preload
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[list[str]] = self._loop.create_future()
        """Done once the imports are over: the failure lines of preloads that did not import."""
        self._forks: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        """Exit codes reported before their fork's handle was made (it died at once)."""
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        """The answer of each fork request on its way, by request id."""
        self._next_id = 0
        self._closed = False
        self._retired = False
        self._unusable = False
        self._log_fds: list[int] = []
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)
        for fd in handle.take_pipes():
            if fd is not None:
                os.set_blocking(fd, False)
                self._log_fds.append(fd)
                self._loop.add_reader(fd, self._on_log, fd)
        self._watcher = asyncio.ensure_future(self._watch())

    @classmethod
    def start(cls, launch: StandbyLaunch, *, spawner: Any = spawn) -> Zygote:
        """Spawn the zygote of `launch`; raises OSError when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            zygote = StandbyLaunch(
                prefix=launch.prefix,
                argv=(
                    *launch.prefix,
                    "--zygote",
                    str(theirs.fileno()),
                    *launch.argv[len(launch.prefix) :],
                ),
                env=launch.env,
                cwd=launch.cwd,
                preload=launch.preload,
            )
            handle = spawner(zygote, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        logger.info("started zygote pid %d preloading %s", handle.pid, ",".join(launch.preload))
        return cls(handle, ours, launch.preload)

    @property
    def pid(self) -> int:
        return self.handle.pid

    def alive(self) -> bool:
        """Running and usable: it can fork (once ready)."""
        return not self._closed and not self._unusable and self.handle.is_alive()

    def is_ready(self) -> bool:
        return self.alive() and self.ready.done() and not self.ready.cancelled()

    def live_forks(self) -> int:
        return sum(1 for f in self._forks.values() if f.is_alive())

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the zygote finished its imports within `timeout` seconds (and still lives)."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self.ready), timeout)
        return self.is_ready()

    async def fork(self) -> tuple[ForkedProcess, int]:
        """A new standby: its handle and the write end of its hand-off pipe (the caller's).

        Raises OSError when the zygote is not ready, refuses, or does not answer in time.
        """
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        hand_r, hand_w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                request = self._request("standby", [out_w, err_w, hand_r], (out_r, err_r))
            finally:
                # Sent, the zygote has copies of its own: the fork holds the only read end of
                # its hand-off pipe, so it sees EOF (and exits) if its request is given up.
                for fd in (out_w, err_w, hand_r):
                    os.close(fd)
            handle = await request
        except BaseException:
            for fd in (out_r, err_r, hand_w):
                os.close(fd)
            raise
        return handle, hand_w

    async def fork_store(self, fds: list[int]) -> ForkedProcess:
        """A warm c10d store host whose stdin, stdout, stderr and hand-off channel are `fds`
        (the caller keeps and closes its copies); OSError as for `fork`."""
        return await self._request("store", fds, (None, None))

    def _request(
        self, kind: str, fds: list[int], pipes: tuple[int | None, int | None]
    ) -> Coroutine[Any, Any, ForkedProcess]:
        """Send the request now (the zygote holds its own copies of `fds` once this returns);
        the coroutine awaits the answer."""
        if not self.is_ready():
            raise OSError(f"zygote pid {self.pid} is not ready")
        sentinel = current_sentinel()
        mark = sentinel.next_mark() if sentinel is not None else ""
        self._next_id += 1
        rid = self._next_id
        data = json.dumps({"op": "fork", "id": rid, "mark": mark, "kind": kind}).encode()
        answer = self._expect(rid)
        try:
            self._sock.sendmsg(
                [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            )
        except BaseException:
            self._waiting.pop(rid, None)
            raise
        return self._forked(rid, answer, pipes, sentinel, mark)

    async def _forked(
        self,
        rid: int,
        answer: asyncio.Future[dict[str, Any]],
        pipes: tuple[int | None, int | None],
        sentinel: Sentinel | None,
        mark: str,
    ) -> ForkedProcess:
        reply = await self._await_reply(rid, answer)
        if reply.get("op") != "forked":
            raise OSError(f"zygote pid {self.pid} refused a fork: {reply.get('error')}")
        pid = reply.get("pid")
        if not _is_pid(pid):
            raise OSError(f"zygote pid {self.pid} answered a bad pid")
        handle = ForkedProcess(pid, pipes, self._loop, sentinel)
        early = self._early_exits.pop(pid, None)
        if early is not None:
            # Its exit was read with (or right after) the answer, before this resumed.
            handle.reported(early)
            return handle
        self._forks[pid] = handle
        if sentinel is not None:
            # Unreaped until the zygote reports it, unless it died at once: ticks 0 then.
            sentinel.watch(pid, start_ticks(pid) or 0, mark)
        return handle

    def _expect(self, rid: int) -> asyncio.Future[dict[str, Any]]:
        """The answer to request `rid`, once it comes (before the request goes out)."""
        if self._closed:
            raise OSError(f"zygote pid {self.pid} is gone")
        answer: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._waiting[rid] = answer
        return answer

    async def _await_reply(
        self, rid: int, answer: asyncio.Future[dict[str, Any]]
    ) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(answer, FORK_REPLY_S)
        except TimeoutError:
            # Broken: no more forks from it, but the workers it forked run on (it is killed
            # once they have exited).
            if not self._closed:
                logger.error(
                    "zygote pid %d did not answer a fork in %g s; it forks no more",
                    self.pid,
                    FORK_REPLY_S,
                )
            self._unusable = True
            self.retire()
            raise OSError(f"zygote pid {self.pid} did not answer in {FORK_REPLY_S:g} s") from None
        finally:
            self._waiting.pop(rid, None)

    def _on_readable(self) -> None:
        while not self._closed:
            try:
                data, ancdata, flags, _ = self._sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(4))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("zygote pid %d: cannot read its socket: %s", self.pid, e)
                self._lost()
                return
            stray = [
                fd
                for level, kind, payload in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                for fd in array.array("i", payload[: len(payload) - len(payload) % 4])
            ]
            for fd in stray:  # a zygote sends no descriptors
                os.close(fd)
            if not data:
                self._lost()
                return
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or stray:
                    raise ValueError("an oversized message or descriptors")
                msg = json.loads(data.decode("utf-8"))
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
                self._dispatch(msg)
            except (ValueError, UnicodeDecodeError) as e:
                logger.error("zygote pid %d broke its protocol (%s); killing it", self.pid, e)
                self.kill()
                return

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready":
            failed = msg.get("failed")
            if not isinstance(failed, list) or not all(isinstance(f, str) for f in failed):
                raise ValueError("a bad ready message")
            threads = msg.get("threads", 1)
            if not self.ready.done():
                for line in failed:
                    logger.warning("zygote pid %d: %s", self.pid, line.strip())
                if isinstance(threads, int) and threads > 1:
                    logger.warning(
                        "zygote pid %d runs %d threads after its imports; its forks have only"
                        " one (a preload that starts threads may make them hang)",
                        self.pid,
                        threads,
                    )
                self.ready.set_result(failed)
        elif op in ("forked", "refused"):
            rid = msg.get("id")
            answer = self._waiting.get(rid) if isinstance(rid, int) else None
            if answer is not None and not answer.done():
                answer.set_result(msg)
        elif op == "exit":
            pid, code = msg.get("pid"), msg.get("code")
            if not _is_pid(pid) or not _is_exit_code(code):
                raise ValueError("a bad exit message")
            fork = self._forks.pop(pid, None)
            if fork is not None:
                fork.reported(code)
            elif self._waiting:
                # A fork whose answer is read but not yet taken up: kept for it, bounded.
                if len(self._early_exits) >= _MAX_EARLY_EXITS:
                    self._early_exits.pop(next(iter(self._early_exits)))
                self._early_exits[pid] = code
            if self._retired and not self.live_forks():
                self.kill()
        else:
            raise ValueError(f"an unknown message {str(op)[:40]!r}")

    def _on_log(self, fd: int) -> None:
        try:
            data = os.read(fd, _MAX_LOG_READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(fd)
            os.close(fd)
            self._log_fds.remove(fd)
            return
        for line in data.decode("utf-8", "replace").splitlines():
            if line.strip():
                logger.info("zygote pid %d: %s", self.pid, line[:500])

    async def _watch(self) -> None:
        await self.handle.wait()
        self._lost()

    def _lost(self) -> None:
        """The zygote is gone (or its socket is): every fork left dies with it."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        if not self.ready.done():
            self.ready.cancel()
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(OSError(f"zygote pid {self.pid} is gone"))
        if self.handle.is_alive():
            self.handle.send_signal_group(signal.SIGKILL)
        forks, self._forks = self._forks, {}
        for fork in forks.values():
            fork.zygote_gone()

    def retire(self) -> None:
        """Kill the zygote once its last fork has exited (now, when none lives)."""
        self._retired = True
        if not self.live_forks():
            self.kill()

    def kill(self) -> None:
        """SIGKILL the zygote now (its forks die with it)."""
        self.handle.send_signal_group(signal.SIGKILL)
        self._lost()

    def close(self) -> None:
        """Stop reading the zygote's output (after it is gone)."""
        for fd in self._log_fds:
            self._loop.remove_reader(fd)
            os.close(fd)
        self._log_fds = []
        self._watcher.cancel()
