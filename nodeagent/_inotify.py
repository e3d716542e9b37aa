"""Knowing the moment a worker's error file is written: inotify on the workers' directories.

`ErrorFileWatch` watches the directory of each error file it is given and calls `on_written(path)`
on the event loop when that file name is closed after writing (torch's ``@record`` writes it in one
``with open(path, "w")``) or moved into place (gelastic's bootstrap and ``client.errors.record``
write a temporary file and rename it). Other names in the directory are ignored. The worker's
process is then usually still tearing down, so the failure is known before its exit.

Linux inotify through libc (ctypes), a non-blocking descriptor read on the loop. Everything is
bounded: the number of watches, the bytes read per wake-up, the reads per wake-up. Where inotify
is not available `start()` returns False and the agent learns of the failure at the exit, as
without this module. A queue overflow re-announces every watched file: the reader checks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

__all__ = ["MAX_WATCHES", "ErrorFileWatch"]

logger = logging.getLogger(__name__)

MAX_WATCHES = 4096
"""Directories one watch follows at most (one per local worker; more are not watched)."""

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_EVENT = struct.Struct("iIII")
_READ_BYTES = 64 * 1024
_READS_PER_WAKE = 16
_MAX_NAME = 255

_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
            lib.inotify_init1.argtypes = [ctypes.c_int]
            lib.inotify_init1.restype = ctypes.c_int
            lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
            lib.inotify_add_watch.restype = ctypes.c_int
        except (OSError, AttributeError):
            return None
        _libc = lib
    return _libc


class ErrorFileWatch:
    """Calls `on_written(path)` when a watched file is written; see the module docstring."""

    def __init__(self, on_written: Callable[[Path], None], *, max_watches: int = MAX_WATCHES):
        self._on_written = on_written
        self._max_watches = max_watches
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._by_wd: dict[int, tuple[Path, set[bytes]]] = {}
        self._wd_by_dir: dict[Path, int] = {}

    @property
    def active(self) -> bool:
        return self._fd is not None

    def start(self) -> bool:
        """Open the inotify descriptor on the running loop; False when inotify is unavailable."""
        if self._fd is not None:
            return True
        libc = _load_libc()
        if libc is None or not hasattr(libc, "inotify_init1"):
            return False
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            logger.info(
                "inotify unavailable (%s); errors are known at the exit",
                os.strerror(ctypes.get_errno()),
            )
            return False
        loop = asyncio.get_running_loop()
        try:
            loop.add_reader(fd, self._on_readable)
        except Exception:
            os.close(fd)
            raise
        self._fd, self._loop = fd, loop
        return True

    def watch(self, path: Path) -> bool:
        """Watch `path` (its directory must exist); False when it cannot be watched."""
        libc = _libc
        if self._fd is None or libc is None:
            return False
        directory, name = path.parent, os.fsencode(path.name)
        wd = self._wd_by_dir.get(directory)
        if wd is not None:
            self._by_wd[wd][1].add(name)
            return True
        if len(self._wd_by_dir) >= self._max_watches:
            return False
        wd = libc.inotify_add_watch(
            self._fd,
            os.fsencode(directory),
            IN_CLOSE_WRITE | IN_MOVED_TO | IN_ONLYDIR | IN_DONT_FOLLOW,
        )
        if wd < 0:
            logger.info(
                "cannot watch %s (%s); its error is known at the exit",
                directory,
                os.strerror(ctypes.get_errno()),
            )
            return False
        self._wd_by_dir[directory] = wd
        self._by_wd[wd] = (directory, {name})
        return True

    def _on_readable(self) -> None:
        if self._fd is None:
            return
        for _ in range(_READS_PER_WAKE):
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                logger.warning("inotify read failed (%s); watching no more", e.strerror)
                self.close()
                return
            if not data:
                return
            self._parse(data)
            if self._fd is None:
                return

    def _parse(self, data: bytes) -> None:
        off = 0
        while off + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
            off += _EVENT.size
            if length > _MAX_NAME + 1 + _EVENT.size or off + length > len(data):
                return  # not an event the kernel makes: drop the rest of this read
            name = data[off : off + length].rstrip(b"\0")
            off += length
            if mask & IN_Q_OVERFLOW:
                # Events were lost: announce every file, the reader tells which were written.
                for directory, names in list(self._by_wd.values()):
                    for n in list(names):
                        self._announce(directory / os.fsdecode(n))
                continue
            if mask & IN_IGNORED:
                entry = self._by_wd.pop(wd, None)
                if entry is not None:
                    self._wd_by_dir.pop(entry[0], None)
                continue
            entry = self._by_wd.get(wd)
            if entry is None or name not in entry[1]:
                continue
            if mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
                self._announce(entry[0] / os.fsdecode(name))

    def _announce(self, path: Path) -> None:
        try:
            self._on_written(path)
        except Exception:
            logger.exception("error-file callback failed for %s", path)

    def close(self) -> None:
        """Stop watching; idempotent."""
        fd = self._detach()
        if fd is not None:
            os.close(fd)  # removes every watch

    async def aclose(self) -> None:
        """Stop watching, the descriptor closed in a thread; idempotent. Closing an inotify
        descriptor waits for the kernel's grace period (milliseconds): not on the loop."""
        fd = self._detach()
        if fd is not None:
            await asyncio.to_thread(os.close, fd)

    def _detach(self) -> int | None:
        """Stop reading; the descriptor, now the caller's to close (None: closed already)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return None
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
        self._by_wd.clear()
        self._wd_by_dir.clear()
        return fd
