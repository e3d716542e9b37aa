"""A torch `FileTimerServer`-compatible watchdog, on the agent's event loop.

Workers use torch's own `FileTimerClient` / `expires()`: each request is one JSON line written to
a FIFO at ``TORCHELASTIC_TIMER_FILE``::

    {"version": 1, "pid": P, "scope_id": "...", "expiration_time": <epoch s>, "signal": 9}

(``expiration_time`` -1 releases the timer.)

Unlike torch's server, an expiry kills only the worker that asked (never the agent), only if it is
a worker of this group, and is reported through `on_expired` so the agent can report a failure.
The FIFO is read when readable (add_reader) and expiries fire from a timer set on the earliest
deadline; nothing polls.

A pid is only a number: the worker may exit and be reaped, and its pid go to a stranger, while
its timer is armed. So the server takes a pidfd of the worker when it arms the first timer of
it, signals through that pidfd (a process that is gone is never confused with one that got its
pid), and forgets every timer of the worker the moment the pidfd says it has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from nodeagent._dirs import private_dir

__all__ = [
    "MAX_TIMER_FILE_CHARS",
    "ExpiredCallback",
    "FileTimerServer",
    "TimerFileError",
    "TimerRequest",
    "validate_timer_file",
]

logger = logging.getLogger(__name__)

ExpiredCallback = Callable[[int, str, int, float], None]
"""on_expired(pid, scope_id, signal, expiration_time)."""

_MAX_LINE = 64 * 1024
_READ_CHUNK = 65536

MAX_TIMER_FILE_CHARS = 1024
"""The longest TORCHELASTIC_TIMER_FILE path a job may name."""

_SERVING: set[str] = set()
"""The FIFO paths this process serves now: two groups must never share one."""


class TimerFileError(ValueError):
    """A TORCHELASTIC_TIMER_FILE the watchdog will not serve; the message says why."""


def validate_timer_file(path: str, *, uid: int | None = None) -> Path:
    """Check a job-given TORCHELASTIC_TIMER_FILE before the watchdog serves it.

    The path must be absolute, at most MAX_TIMER_FILE_CHARS long and free of NUL; its parent
    must be an existing directory (not a symlink) owned by `uid` (default: this process's) and
    writable by no one else; the path itself, if present, must be a FIFO of `uid` (one left by
    an earlier run; anything else is never removed). Raises TimerFileError naming the problem.
    """
    uid = os.geteuid() if uid is None else uid
    what = "TORCHELASTIC_TIMER_FILE"
    if "\0" in path:
        raise TimerFileError(f"{what} contains a NUL character")
    if len(path) > MAX_TIMER_FILE_CHARS:
        raise TimerFileError(
            f"{what} is {len(path)} characters long, over the limit of {MAX_TIMER_FILE_CHARS}"
        )
    if not os.path.isabs(path):
        raise TimerFileError(f"{what} must be an absolute path, got {path!r}")
    if os.path.basename(path) in ("", ".", ".."):
        raise TimerFileError(f"{what} {path!r} does not name a file")
    parent = os.path.dirname(path)
    try:
        pst = os.lstat(parent)
    except OSError as e:
        raise TimerFileError(
            f"{what} {path!r}: its directory {parent!r} cannot be used: {e.strerror}"
        ) from None
    if stat.S_ISLNK(pst.st_mode):
        raise TimerFileError(f"{what} {path!r}: its directory {parent!r} is a symlink")
    if not stat.S_ISDIR(pst.st_mode):
        raise TimerFileError(f"{what} {path!r}: {parent!r} is not a directory")
    if pst.st_uid != uid:
        raise TimerFileError(
            f"{what} {path!r}: its directory {parent!r} is owned by uid {pst.st_uid}, "
            f"not by the agent's uid {uid}"
        )
    if pst.st_mode & 0o022:
        raise TimerFileError(
            f"{what} {path!r}: its directory {parent!r} is writable by others "
            f"(mode {stat.S_IMODE(pst.st_mode):o})"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Path(path)
    except OSError as e:
        raise TimerFileError(f"{what} {path!r} cannot be used: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise TimerFileError(f"{what} {path!r} is a symlink")
    if not stat.S_ISFIFO(st.st_mode):
        raise TimerFileError(f"{what} {path!r} exists and is not a FIFO; it is left alone")
    if st.st_uid != uid:
        raise TimerFileError(f"{what} {path!r} is a FIFO of uid {st.st_uid}, not the agent's")
    return Path(path)


@dataclass(frozen=True)
class TimerRequest:
    """One parsed line of the FileTimer protocol."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def is_release(self) -> bool:
        return self.expiration_time < 0


def parse_request(line: bytes) -> TimerRequest:
    """Parse one request line; raises ValueError saying what is wrong."""
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        pid, scope_id, expiration, sig = (
            data["pid"],
            data["scope_id"],
            data["expiration_time"],
            data["signal"],
        )
    except KeyError as e:
        raise ValueError(f"missing key {e.args[0]!r}") from None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"bad pid {pid!r}")
    if not isinstance(scope_id, str):
        raise ValueError(f"bad scope_id {scope_id!r}")
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise ValueError(f"bad expiration_time {expiration!r}")
    if math.isnan(expiration):
        raise ValueError("expiration_time is NaN")
    if isinstance(sig, bool) or not isinstance(sig, int):
        raise ValueError(f"bad signal {sig!r}")
    return TimerRequest(pid, scope_id, float(expiration), sig)


class FileTimerServer:
    """Serves torch's FileTimer protocol at `path` for the workers of one group."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allowed_pids: Collection[int] | Callable[[int], bool],
        on_expired: ExpiredCallback,
        clock: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] | None = None,
    ) -> None:
        """`kill(pid, signal)` replaces the pidfd signalling (tests of the expiry rules)."""
        self.path = Path(path)
        self._allowed = allowed_pids
        self._on_expired = on_expired
        self._clock = clock
        self._kill = kill
        self._timers: dict[tuple[int, str], TimerRequest] = {}
        self._pidfds: dict[int, int] = {}
        """{pid: pidfd} of the workers with armed timers (-1: no pidfds on this kernel)."""
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._buffer = bytearray()
        self._discarding = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._fifo_id: tuple[int, int] | None = None
        """(st_dev, st_ino) of the FIFO this server made: close() removes only that one."""

    @property
    def timers(self) -> dict[tuple[int, str], TimerRequest]:
        """Armed timers by (pid, scope_id)."""
        return dict(self._timers)

    def _is_allowed(self, pid: int) -> bool:
        if callable(self._allowed):
            return bool(self._allowed(pid))
        return pid in self._allowed

    def start(self) -> None:
        """Create the FIFO and start reading it; call from the event loop."""
        if self._loop is not None:
            return
        key = os.path.abspath(self.path)
        if key in _SERVING:
            raise TimerFileError(
                f"TORCHELASTIC_TIMER_FILE {str(self.path)!r} is served for another job on "
                "this node; give each job its own"
            )
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(f"watchdog timer file {self.path} is a directory")
            if not stat.S_ISFIFO(st.st_mode):
                # Only a FIFO left by an earlier server is replaced; a user's file never is.
                raise TimerFileError(
                    f"watchdog timer file {self.path} exists and is not a FIFO; it is left alone"
                )
            os.unlink(self.path)
        if not self.path.parent.is_dir():
            private_dir(self.path.parent)
        os.mkfifo(self.path, 0o600)
        st = os.lstat(self.path)
        self._fifo_id = (st.st_dev, st.st_ino)
        _SERVING.add(key)
        # Non-blocking reader first (a FIFO open for write fails without a reader); then a
        # writer of our own, so the reader never sees EOF between clients.
        self._read_fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._write_fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._loop.add_reader(self._read_fd, self._on_readable)
        for pid, fd in self._pidfds.items():  # timers armed before the loop was known
            if fd >= 0:
                self._loop.add_reader(fd, self.forget_pid, pid)
        logger.info("watchdog serving FileTimer requests at %s", self.path)

    def _on_readable(self) -> None:
        assert self._read_fd is not None
        while True:
            try:
                chunk = os.read(self._read_fd, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._feed(chunk)
        self._reschedule()

    def _feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        while True:
            nl = self._buffer.find(b"\n")
            if nl < 0:
                if len(self._buffer) > _MAX_LINE:
                    logger.warning("watchdog: dropping a request line over %d bytes", _MAX_LINE)
                    self._buffer.clear()
                    self._discarding = True
                return
            line = bytes(self._buffer[:nl])
            del self._buffer[: nl + 1]
            if self._discarding:
                self._discarding = False
                continue
            if line.strip():
                self._handle_line(line)

    def _handle_line(self, line: bytes) -> None:
        try:
            req = parse_request(line)
        except ValueError as e:
            logger.warning("watchdog: ignoring malformed request %r: %s", line[:200], e)
            return
        self.register(req)

    def register(self, req: TimerRequest) -> None:
        """Arm or release one timer (what a request line does)."""
        key = (req.pid, req.scope_id)
        if req.is_release:
            self._timers.pop(key, None)
            if not any(k[0] == req.pid for k in self._timers):
                self._close_pidfd(req.pid)
            return
        if not self._is_allowed(req.pid):
            logger.warning(
                "watchdog: ignoring timer %r for pid %d, which is not a worker of this group",
                req.scope_id,
                req.pid,
            )
            return
        if self._kill is None and not self._hold_pidfd(req.pid):
            logger.info(
                "watchdog: ignoring timer %r of pid %d, which has exited", req.scope_id, req.pid
            )
            return
        self._timers[key] = req

    def _hold_pidfd(self, pid: int) -> bool:
        """Take (once) a pidfd of worker `pid`; False when it is gone already."""
        if pid in self._pidfds:
            return True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as e:
            # Kernels before 5.3 have no pidfds: then signal by pid (what torch's server does).
            logger.debug("watchdog: pidfd_open(%d) unavailable (%s); signalling by pid", pid, e)
            self._pidfds[pid] = -1
            return True
        self._pidfds[pid] = fd
        if self._loop is not None and not self._closed:
            # Readable once the process has exited (reaped or not): its timers end with it.
            self._loop.add_reader(fd, self.forget_pid, pid)
        return True

    def _close_pidfd(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is None or fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)

    def _signal(self, pid: int, sig: int) -> None:
        """Send `sig` to worker `pid`; ProcessLookupError when it has exited."""
        if self._kill is not None:
            self._kill(pid, sig)
            return
        fd = self._pidfds.get(pid)
        if fd is None:
            raise ProcessLookupError(pid)  # never armed through register: not ours to signal
        if fd < 0:
            os.kill(pid, sig)  # no pidfds on this kernel (see _hold_pidfd)
        else:
            signal.pidfd_send_signal(fd, sig)

    def forget_pid(self, pid: int) -> None:
        """Drop every timer of a worker that has exited."""
        for key in [k for k in self._timers if k[0] == pid]:
            del self._timers[key]
        self._close_pidfd(pid)
        self._reschedule()

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closed or not self._timers or self._loop is None:
            return
        earliest = min(t.expiration_time for t in self._timers.values())
        delay = max(0.0, earliest - self._clock())
        self._timer = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.expire(self._clock())
        self._reschedule()

    def expire(self, now: float) -> list[TimerRequest]:
        """Kill the workers whose timers expired at `now`; returns the timers that killed."""
        expired: dict[int, list[TimerRequest]] = {}
        for req in self._timers.values():
            if req.expiration_time <= now:
                expired.setdefault(req.pid, []).append(req)
        fired: list[TimerRequest] = []
        for pid, reqs in expired.items():
            reqs.sort(key=lambda r: r.expiration_time)
            for r in reqs:
                del self._timers[(r.pid, r.scope_id)]
            chosen = next((r for r in reqs if r.signal > 0), None)
            if chosen is None:
                logger.info(
                    "watchdog: timer(s) %s of pid %d expired with no signal; not killing",
                    [r.scope_id for r in reqs],
                    pid,
                )
                continue
            if pid == os.getpid() or not self._is_allowed(pid):
                logger.warning(
                    "watchdog: timer %r expired for pid %d, which is not a worker of this "
                    "group; not killing",
                    chosen.scope_id,
                    pid,
                )
                continue
            logger.warning(
                "watchdog: timer %r of pid %d expired at %.3f; sending signal %d",
                chosen.scope_id,
                pid,
                chosen.expiration_time,
                chosen.signal,
            )
            try:
                self._signal(pid, chosen.signal)
            except ProcessLookupError:
                # It exited by itself: its exit is its own, not the watchdog's doing.
                logger.info("watchdog: pid %d already exited; not killed", pid)
                self._forget_quietly(pid)
                continue
            except OSError:
                logger.exception("watchdog: could not signal pid %d", pid)
                continue
            # Every timer of a killed worker is void.
            self._forget_quietly(pid)
            fired.append(chosen)
            try:
                self._on_expired(pid, chosen.scope_id, chosen.signal, chosen.expiration_time)
            except Exception:
                logger.exception("watchdog: on_expired callback failed")
        return fired

    def _forget_quietly(self, pid: int) -> None:
        for key in [k for k in self._timers if k[0] == pid]:
            del self._timers[key]
        self._close_pidfd(pid)

    def close(self) -> None:
        """Stop serving and remove the FIFO; idempotent."""
        self._closed = True
        for pid in list(self._pidfds):
            self._close_pidfd(pid)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._read_fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._read_fd)
            os.close(self._read_fd)
            self._read_fd = None
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self._fifo_id is not None:
            _SERVING.discard(os.path.abspath(self.path))
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._fifo_id:
                    os.unlink(self.path)
            self._fifo_id = None
        self._timers.clear()
