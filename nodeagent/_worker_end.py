"""How a python worker whose target is done ends: loaded by path by `_bootstrap.py`.

Standalone, like the bootstrap: the standard library only, and torch only if the worker
loaded it itself. `finish` is the whole end: `release_process_group` destroys a gloo group
the worker left initialized; `leave_before_teardown` ends a worker that loaded torch without
the interpreter's teardown; `spare_the_last_collections` keeps the final collections of any
other worker cheap.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RELEASE_PG_TIMEOUT_S = 10.0
"""How long the end of a successful worker waits for its gloo process group to be destroyed."""


def finish(code: object) -> None:
    """The target is done with exit status `code` (what `sys.exit` got; 0 after a return, 1
    after a recorded failure): a success releases its process group, a worker that loaded
    torch leaves here with an int status, any other returns to python's exit."""
    if code in (None, 0):
        release_process_group()
    if code is None or (isinstance(code, int) and not isinstance(code, bool)):
        leave_before_teardown(code or 0)
    spare_the_last_collections()


def spare_the_last_collections() -> None:
    """The target is done: leave what it built out of the interpreter's final collections.

    While python finalizes it collects garbage several times, each a walk over every tracked
    object. A torch worker holds some 300,000 of them (torch, sympy, torch._dynamo), so those
    walks cost it about a second of CPU after its work, up to tens of seconds of wall time on
    a loaded host (the rank has printed its last line and still runs). Frozen objects are never
    walked. The rest of the exit is python's: thread joins, atexit handlers, the stdio flush,
    and module teardown, which still closes (and flushes) the files a script left open. What
    changes: a `__del__` of an object still alive at exit may not run, which python never
    promised. (`gc.freeze` is 3.7+.)
    """
    freeze = getattr(gc, "freeze", None)
    if freeze is not None:
        freeze()


def leave_before_teardown(code: int) -> None:
    """A worker that loaded torch ends without the interpreter's teardown; others return.

    Python ends a process in two halves. The first is what programs are promised: non-daemon
    threads are joined, atexit handlers run (logging's flush, multiprocessing's joins of its
    children, tempfile's and weakref.finalize's cleanups, torch's own), the standard streams
    are flushed. The second tears the interpreter down: a thread that still wants the GIL is
    ended in the middle of its native call, modules are cleared, C++ static destructors run.
    torch's native threads do not always survive that half: now and then a rank whose work is
    done, its process group destroyed, is aborted there (SIGABRT, "terminate called without an
    active exception", no Python frame) and a job that did all its work ends FAILED. torchrun
    shows the same. So a torch worker runs the first half itself, closes the files it left
    open (module teardown would have), and leaves with `os._exit(code)`. What changes: the
    `__del__` of an object still alive at exit does not run, which python never promised.
    """
    if "torch" not in sys.modules:
        return
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # joins the non-daemon threads, as python's exit does first
        shutdown()
    import atexit

    atexit._run_exitfuncs()
    _close_open_files()
    os._exit(code & 0xFF)


def _close_open_files() -> None:
    """Close every file object still open, each after the files that write through it.

    What module teardown does for files a script never closed: a text file's last characters
    reach its buffer, a gzip writer's data and trailer reach the file under it, a buffered
    file's last bytes reach the disk. The standard streams are flushed, not closed.
    """
    import _io

    base = _io._IOBase  # concrete: no ABC check
    std = [sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__]
    keep: set[int] = set()
    for s in std:
        while s is not None and id(s) not in keep:
            keep.add(id(s))
            s = getattr(s, "buffer", None) or getattr(s, "raw", None)
    found = (o for o in gc.get_objects() if issubclass(type(o), base))  # no `__class__` read
    files = {id(o): o for o in found if id(o) not in keep}
    under: dict[int, list[int]] = {}  # a file -> the files it writes through
    wrappers = dict.fromkeys(files, 0)
    for key, f in files.items():
        inner = [id(r) for r in _referents(f) if id(r) in files and id(r) != key]
        under[key] = inner
        for i in inner:
            wrappers[i] += 1
    ready = [key for key, n in wrappers.items() if n == 0]
    done: set[int] = set()
    while ready or len(done) < len(files):
        if not ready:  # a cycle of files: the rest in any order
            ready = [key for key in files if key not in done][:1]
        key = ready.pop()
        if key in done:
            continue
        done.add(key)
        try:
            if not files[key].closed:
                files[key].close()
        except Exception:
            pass  # like teardown: a file that cannot be closed is left to the exit
        for i in under[key]:
            wrappers[i] -= 1
            if wrappers[i] == 0:
                ready.append(i)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _referents(f: Any) -> list[Any]:
    """What `f` holds directly, its instance attributes included."""
    out: list[Any] = []
    for r in gc.get_referents(f):
        out.extend(r.values() if type(r) is dict else (r,))
    return out


def release_process_group() -> None:
    """Destroy a gloo process group the worker left initialized, before the interpreter ends.

    A script that returns without `destroy_process_group()` leaves gloo's worker thread
    holding its last finished work; when the interpreter then finalizes, that thread drops the
    work's tensor, needs the GIL, is ended by CPython, and the unwind through a noexcept
    destructor aborts the process (SIGABRT, "terminate called without an active exception")
    after the rank did all its work. Destroying the group first joins that thread while the
    interpreter is whole. Only gloo: it is local and quick; torch is never imported here (only a
    torch the worker loaded itself is used), and a destroy that does not end within a bound is
    left behind rather than waited on.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
            return
    except Exception:
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:
            pass  # the work is done; a failed teardown must not turn success into failure
        finally:
            done.set()

    threading.Thread(target=destroy, name="gelastic-pg-release", daemon=True).start()
    done.wait(RELEASE_PG_TIMEOUT_S)
