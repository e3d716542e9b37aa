"""Runs one python worker the way ``python`` would, and records why it died.

This file is executed by path under whatever python3 (3.7+) the job asked for, so it imports
only the standard library and nothing of gelastic. It enables faulthandler, runs the target
(a script, ``-m`` module, ``-c`` code, or a ``module:qualname`` function), and on an uncaught
exception writes torchelastic's error file (``TORCHELASTIC_ERROR_FILE``) in torch's nested
format, then exits like python does (traceback on stderr, exit code 1).

Usage::

    python [interpreter flags] _bootstrap.py --error-file PATH
        (--script PATH | --module NAME | --code CODE
         | --function MOD:QUALNAME --args-file PATH --return-file PATH [--main-path PATH])
        -- [target args...]

A function ``__main__:QUALNAME`` comes with ``--main-path``, the submitter's main script: it is
run as module ``__mp_main__`` (so its ``if __name__ == "__main__":`` block does not run), which
also becomes ``sys.modules["__main__"]`` so that pickles naming ``__main__`` resolve, as
multiprocessing's spawn start method does.

    python [interpreter flags] _bootstrap.py --standby FD [--preload MODULE]...

A standby (see nodeagent._standby) imports the preload modules, then blocks reading one JSON
hand-off ``{"argv": [...], "env": {...}}`` (at most ``MAX_HANDOFF_BYTES``) from the inherited
pipe FD that only its agent holds; it then takes that environment and runs as if started with
that argv. EOF without a hand-off: it exits 0 at once.

    python [interpreter flags] _bootstrap.py --zygote FD [--preload MODULE]...

A zygote (see nodeagent._zygote) imports the preload modules once and then forks standbys on
its agent's request over the inherited socket FD (`_zygote`); each fork then is a standby as
above, reading its hand-off from the pipe the request brought.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import importlib.machinery
import importlib.util
import os
import runpy
import signal
import sys
import time
import types

# What a worker runs before its target's first line is kept to what every worker needs: the
# modules only a function's return value, a failure or a zip needs are imported there.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

_HERE = os.path.dirname(os.path.abspath(__file__))
# Frames python itself never shows above the target's code.
_HIDDEN_MODULES = frozenset(
    {"runpy", "importlib", "importlib._bootstrap", "importlib._bootstrap_external"}
)
_USAGE = (
    "usage: _bootstrap.py --error-file PATH (--script PATH | --module NAME | --code CODE | "
    "--function MOD:QUALNAME --args-file PATH --return-file PATH) -- [args...]"
)
# The args file; kept in step with nodeagent._launch (function_args_file). The return value's
# format is `_return_value.py`'s.
_ARGS_MAGIC = b"GELASTIC-ARGS/1\n"
_MAX_ARGS_HEADER = 4096
MAX_HANDOFF_BYTES = 4 * 1024 * 1024
"""Largest hand-off a standby reads; kept in step with nodeagent._standby."""
# Kept by a standby through its hand-off: they name the agent and mark of this very process.
_OWN_ENV = ("GELASTIC_AGENT_PID", "GELASTIC_WORKER_MARK")


class _Options:
    def __init__(self) -> None:
        self.error_file = ""
        self.mode = ""
        self.target = ""
        self.args_file = ""
        self.return_file = ""
        self.main_path = ""
        self.rest: list[str] = []


def _usage_error(message: str) -> NoReturn:
    sys.stderr.write(f"gelastic bootstrap: {message}\n{_USAGE}\n")
    sys.exit(2)


def _parse(argv: list[str]) -> _Options:
    opts = _Options()
    modes = {"--script": "script", "--module": "module", "--code": "code", "--function": "function"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            opts.rest = argv[i + 1 :]
            break
        if i + 1 >= len(argv):
            _usage_error(f"option {arg} needs a value")
        value = argv[i + 1]
        if arg == "--error-file":
            opts.error_file = value
        elif arg in modes:
            if opts.mode:
                _usage_error("give exactly one of --script, --module, --code, --function")
            opts.mode = modes[arg]
            opts.target = value
        elif arg == "--args-file":
            opts.args_file = value
        elif arg == "--return-file":
            opts.return_file = value
        elif arg == "--main-path":
            opts.main_path = value
        else:
            _usage_error(f"unknown option {arg}")
        i += 2
    if not opts.mode:
        _usage_error("no target given")
    if opts.mode == "function" and not opts.return_file:
        _usage_error("--function needs --return-file")
    if opts.main_path and opts.mode != "function":
        _usage_error("--main-path is only for --function")
    return opts


def _file_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_error_file(path: str, message: str, callstack: str) -> None:
    import json

    if not path:
        return
    now_ns = time.time_ns()
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                # Whole seconds, as torch writes them: torch's own reader int()s this field.
                # The nanoseconds order near-simultaneous failures; our reader prefers them.
                "timestamp": str(now_ns // 1_000_000_000),
                "timestamp_ns": str(now_ns),
            },
        }
    }
    try:
        _atomic_write(path, json.dumps(data).encode("utf-8"))
    except OSError as e:
        sys.stderr.write(f"gelastic bootstrap: cannot write error file {path}: {e}\n")


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    # Drop the bootstrap's and runpy's own frames so the traceback reads like `python x.py`.
    # (runpy may be frozen, so it is recognised by module name, not by file.)
    own = globals()
    while tb is not None:
        frame_globals = tb.tb_frame.f_globals
        if frame_globals is own or frame_globals.get("__name__") in _HIDDEN_MODULES:
            tb = tb.tb_next
            continue
        break
    return tb


def _fix_sys_path(opts: _Options) -> None:
    # Python put this file's directory first; the target expects its own (as `python x.py`).
    if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == os.path.realpath(_HERE):
        del sys.path[0]
    if getattr(sys.flags, "safe_path", False) or getattr(sys.flags, "isolated", False):
        return
    if opts.mode == "script":
        sys.path.insert(0, os.path.dirname(os.path.realpath(opts.target)))
    elif opts.mode == "code":
        sys.path.insert(0, "")
    else:
        sys.path.insert(0, os.getcwd())
        if opts.main_path:  # the script's own imports find what `python script.py` finds
            sys.path.insert(0, os.path.dirname(os.path.realpath(opts.main_path)))


def _import_main_script(path: str) -> types.ModuleType:
    """Run the submitter's main script as ``__mp_main__`` and make it ``__main__`` too.

    multiprocessing.spawn._fixup_main_from_path does the same: the script's top level runs, its
    ``if __name__ == "__main__":`` block does not, and ``__main__.X`` in a pickle is its X.
    """
    filename = os.path.abspath(path)
    main = types.ModuleType("__mp_main__")
    content = runpy.run_path(filename, run_name="__mp_main__")
    main.__dict__.update(content)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    return main


def _resolve_function(ref: str, main_path: str = "") -> Any:
    module_name, _, qualname = ref.partition(":")
    if module_name == "__main__":
        if not main_path:
            raise ImportError(f"{ref} is a function of a main script, and no --main-path was given")
        obj: Any = _import_main_script(main_path)
    else:
        obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _read_args_file(path: str) -> tuple[bytes, bytes, str, int]:
    """(pickled args, result key, job id, global rank) from the agent's args file."""
    import json

    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_ARGS_MAGIC):
        return data, b"", "", -1  # a bare pickle: nothing to tag the return value with
    end = data.find(b"\n", len(_ARGS_MAGIC), len(_ARGS_MAGIC) + _MAX_ARGS_HEADER)
    if end < 0:
        raise ValueError(f"the args file {path} has no valid header")
    header = json.loads(data[len(_ARGS_MAGIC) : end].decode("utf-8"))
    key = bytes.fromhex(str(header.get("result_key", "")))
    return data[end + 1 :], key, str(header.get("job_id", "")), int(header.get("rank", -1))


def _run_function(opts: _Options) -> None:
    fn = _resolve_function(opts.target, opts.main_path)
    args: Any = ()
    kwargs: Any = {}
    key, job_id, rank = b"", "", -1
    if opts.args_file:
        payload, key, job_id, rank = _read_args_file(opts.args_file)
        if payload:
            import pickle

            args, kwargs = pickle.loads(payload)
    result = fn(*args, **kwargs)
    try:
        data = _load_sibling("_return_value").return_value_bytes(result, key, job_id, rank)
    except Exception as e:
        message = f"return value of {opts.target} cannot be pickled: {type(e).__name__}: {e}"
        sys.stderr.write(message + "\n")
        import traceback

        _write_error_file(opts.error_file, message, traceback.format_exc())
        sys.exit(1)
    _atomic_write(opts.return_file, data)


def _new_main(filename: str | None) -> types.ModuleType:
    # The target becomes the real __main__ (and stays it, for atexit handlers and pickling).
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    if filename is not None:
        main.__dict__["__file__"] = filename
        main.__dict__["__cached__"] = None
        main.__dict__["__loader__"] = importlib.machinery.SourceFileLoader("__main__", filename)
    sys.modules["__main__"] = main
    return main


_ZIP_END = b"PK\x05\x06"
"""The signature of a zip's end-of-central-directory record, which ends every zip."""
_ZIP_TAIL = 22 + 65535
"""The record and the longest comment after it: a zip has the signature in its last bytes."""


def _run_code(code: str) -> None:
    main = _new_main(None)
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _run_script(path: str) -> None:
    if not os.path.isfile(path):
        # A directory with __main__.py: runpy knows how.
        runpy.run_path(path, run_name="__main__")
        return
    # Like `python x.py`: argv[0] stays as given, __file__ and code paths are absolute.
    filename = os.path.abspath(path)
    with open(filename, "rb") as f:
        source = f.read()
    if _ZIP_END in source[-_ZIP_TAIL:]:
        import zipfile  # only for a file that may be a zip: most scripts never pay for it

        if zipfile.is_zipfile(path):
            # A zip with __main__.py (a zipapp): runpy knows how.
            runpy.run_path(path, run_name="__main__")
            return
    main = _new_main(filename)
    exec(compile(source, filename, "exec"), main.__dict__)


def _run(opts: _Options) -> None:
    if opts.mode == "script":
        sys.argv = [opts.target, *opts.rest]
        if not os.path.exists(opts.target):
            # `python missing.py` says this and exits 2.
            message = (
                f"can't open file {os.path.abspath(opts.target)!r}: "
                "[Errno 2] No such file or directory"
            )
            sys.stderr.write(f"{sys.executable}: {message}\n")
            if not os.path.isabs(opts.target):
                # Not where the submitter ran: a job without a cwd runs in its agent's.
                hint = (
                    f"{opts.target} was looked for in the worker's directory {os.getcwd()}: "
                    "give the job its directory (gelastic submit --cwd DIR, cwd= in the API) "
                    "or the script's absolute path"
                )
                sys.stderr.write(f"gelastic: {hint}\n")
                message = f"{message}; {hint}"
            _write_error_file(opts.error_file, message, "")
            sys.exit(2)
        _run_script(opts.target)
    elif opts.mode == "module":
        sys.argv = ["-m", *opts.rest]
        runpy.run_module(opts.target, run_name="__main__", alter_sys=True)
    elif opts.mode == "code":
        sys.argv = ["-c", *opts.rest]
        _run_code(opts.target)
    else:
        sys.argv = [opts.target, *opts.rest]
        _run_function(opts)


def _die_with_agent() -> None:
    # The agent spawns without running Python between fork and exec, so the worker arms the
    # parent-death signal itself, first thing, with the exec stub's own code beside this file.
    # (Without GELASTIC_AGENT_PID no agent started us; under one, the agent's sentinel kills
    # this session too, so a worker whose signal could not be armed still dies with its agent.)
    parent = os.environ.get("GELASTIC_AGENT_PID", "")
    if not parent.isdigit():
        return
    module = _load_sibling("_pdeathsig")
    if module is not None:
        module.arm(int(parent))


def _load_sibling(name: str) -> Any:
    """A standalone module beside this file, loaded by path: nodeagent is not importable here."""
    path = os.path.join(_HERE, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_gelastic{name}", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker_end() -> Any:
    """`_worker_end.py`: how a worker whose target is done ends (loaded only then)."""
    return _load_sibling("_worker_end")


def _read_handoff(fd: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_HANDOFF_BYTES:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    os.close(fd)
    if size > MAX_HANDOFF_BYTES:
        _usage_error(f"standby hand-off over {MAX_HANDOFF_BYTES} bytes")
    return b"".join(chunks)


def parse_handoff(data: bytes) -> tuple[list[str], dict[str, str]]:
    """(bootstrap argv, environment) of a hand-off; ValueError when it is not one."""
    import json

    msg = json.loads(data.decode("utf-8"))
    if not isinstance(msg, dict):
        raise ValueError("the hand-off is not an object")
    argv, env = msg.get("argv"), msg.get("env")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("the hand-off argv is not a list of strings")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\x00" not in k + v
        for k, v in env.items()
    ):
        raise ValueError("the hand-off env is not a mapping of names to strings")
    return argv, env


def _preload_options(argv: list[str], mode: str) -> tuple[int, list[str]]:
    """(descriptor, preload modules) of ``--standby FD`` / ``--zygote FD`` and ``--preload M``."""
    fd = -1
    preload: list[str] = []
    i = 0
    while i + 1 < len(argv):
        if argv[i] == mode and argv[i + 1].isdigit():
            fd = int(argv[i + 1])
        elif argv[i] == "--preload":
            preload.append(argv[i + 1])
        else:
            _usage_error(f"unknown standby option {argv[i]}")
        i += 2
    if fd < 0 or i != len(argv):
        _usage_error(f"{mode} needs a descriptor")
    return fd, preload


def _import_preload(preload: list[str]) -> list[str]:
    """Import the preload modules; the messages of those that failed."""
    # Not this directory: a preload is found on the interpreter's own path, never among the
    # agent's files; the hand-off puts the target's directory first, as a cold start does.
    if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == os.path.realpath(_HERE):
        del sys.path[0]
    failed: list[str] = []
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # the target fails (or not) on its own import, as cold
            failed.append(f"gelastic standby: cannot preload {name}: {type(e).__name__}: {e}\n")
    return failed


def _standby(argv: list[str]) -> list[str]:
    """Preload, wait for the round's hand-off, take its env; returns the round's argv."""
    fd, preload = _preload_options(argv, "--standby")
    for line in _import_preload(preload):
        sys.stderr.write(line)
    return _take_handoff(fd)


def _take_handoff(fd: int) -> list[str]:
    """Block for the round's hand-off on `fd`, take its env; returns the round's argv."""
    # What reading the hand-off needs is imported before the wait, off the round's path: json
    # and the re it brings are milliseconds of each rank's CPU, and a restart waits for all.
    import json  # noqa: F401

    data = _read_handoff(fd)
    if not data:
        sys.exit(0)  # the agent let this standby go unused
    try:
        round_argv, env = parse_handoff(data)
    except (ValueError, UnicodeDecodeError) as e:
        _usage_error(f"bad standby hand-off: {e}")
    own = {k: os.environ[k] for k in _OWN_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(own)
    return round_argv


MAX_ZYGOTE_MESSAGE = 16384
"""Largest message either end of a zygote's socket sends; kept in step with nodeagent._zygote."""
MAX_ZYGOTE_FORKS = 1024
"""Most live forks one zygote keeps; a fork request beyond is refused."""
# What a fork request brings (SCM_RIGHTS), by kind: a standby's stdout and stderr (write ends)
# and hand-off (read end); a warm c10d store host's stdin (read end), status pipe (its stdout),
# log (its stderr) and hand-off channel. They become descriptors 1, 2, 3 (stdin /dev/null) or
# 0, 1, 2, 3 of the fork.
_ZYGOTE_FDS = {"standby": 3, "store": 4}
_MAX_ZYGOTE_FDS = 4
_MARK_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ._-")
_MAX_FAILURE_CHARS = 300


def _zsend(sock: Any, msg: dict[str, Any]) -> None:
    import json

    data = json.dumps(msg).encode("utf-8")
    if len(data) > MAX_ZYGOTE_MESSAGE:
        data = json.dumps({"op": msg.get("op", ""), "error": "message too long"}).encode()
    sock.sendmsg([data])


class _Refused(ValueError):
    def __init__(self, rid: int, message: str) -> None:
        super().__init__(message)
        self.rid = rid


def _fork_request(data: bytes, fds: list[int]) -> tuple[int, str, str]:
    """(request id, worker mark, kind) of a well-formed fork request; `_Refused` otherwise."""
    import json

    try:
        msg = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise _Refused(-1, f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise _Refused(-1, "not an object")
    rid = msg.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 1 << 53:
        raise _Refused(-1, "the request id is not a small non-negative integer")
    mark = msg.get("mark", "")
    if msg.get("op") != "fork":
        raise _Refused(rid, "not a fork request")
    if not isinstance(mark, str) or len(mark) > 128 or not set(mark) <= _MARK_CHARS:
        raise _Refused(rid, "the worker mark is not a short token")
    kind = msg.get("kind", "standby")
    if not isinstance(kind, str) or kind not in _ZYGOTE_FDS:
        raise _Refused(rid, "not a kind of fork")
    if len(fds) != _ZYGOTE_FDS[kind]:
        raise _Refused(rid, f"a {kind} fork brings {_ZYGOTE_FDS[kind]} descriptors, not {len(fds)}")
    return rid, mark, kind


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    import socket

    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, usable, 4))
    return fds


def _zygote(argv: list[str]) -> list[str]:
    """Preload once, then fork standbys on request; returns only in a fork (its round's argv).

    ``--zygote FD [--preload M]...``: FD is one end of an AF_UNIX SOCK_SEQPACKET socketpair
    whose other end only the agent holds. After the imports (and `gc.freeze`, so forks share the
    imported objects' pages) the zygote says ``{"op": "ready", "pid", "failed"}``, then serves
    ``{"op": "fork", "id", "mark"}`` requests that carry (SCM_RIGHTS) the fork's stdout and stderr
    write ends and its hand-off read end, and answers ``forked`` (with the pid) or ``refused``.
    It waits for its forks and reports each one's exit (``{"op": "exit", "pid", "code"}``, code
    negative for a signal) after SIGKILLing what is left in its process group. Messages are JSON
    of at most `MAX_ZYGOTE_MESSAGE` bytes; nothing else is accepted. EOF: it kills its forks and
    exits. See nodeagent._zygote for the agent's end.
    """
    import select
    import socket

    fd, preload = _preload_options(argv, "--zygote")
    sock = socket.socket(fileno=fd)
    failed = [line[:_MAX_FAILURE_CHARS] for line in _import_preload(preload)]
    for line in failed:
        sys.stderr.write(line)
    pdeathsig = _load_sibling("_pdeathsig")
    freeze = getattr(gc, "freeze", None)
    if freeze is not None:
        freeze()
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    me = os.getpid()
    # A fork has only the thread that forked: a preload that started threads is said (and
    # its forks may hang on a lock one of them held).
    threads = len(os.listdir("/proc/self/task"))
    _zsend(sock, {"op": "ready", "pid": me, "failed": failed, "threads": threads})
    poller = select.poll()  # not select: a preload may have opened many descriptors
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_r in ready:
            with contextlib.suppress(OSError):
                while os.read(wake_r, 4096):
                    pass
            _reap_forks(sock, children)
        if sock.fileno() not in ready:
            continue
        data, ancillary, flags, _ = sock.recvmsg(
            MAX_ZYGOTE_MESSAGE + 1, socket.CMSG_SPACE(_MAX_ZYGOTE_FDS * 4)
        )
        fds = _received_fds(ancillary)
        if not data and not fds:
            for pid in children:  # the agent is gone or let this zygote go
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            os._exit(0)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise _Refused(-1, "the request is too long")
            rid, mark, kind = _fork_request(data, fds)
            if len(children) >= MAX_ZYGOTE_FORKS:
                raise _Refused(rid, f"{MAX_ZYGOTE_FORKS} forks are alive already")
        except _Refused as e:
            for f in fds:
                os.close(f)
            _zsend(sock, {"op": "refused", "id": e.rid, "error": str(e)[:_MAX_FAILURE_CHARS]})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            if kind == "store":
                _become_fork(sock, (wake_r, wake_w), fds, mark, me, pdeathsig)
                # The c10d store host, warm: it dies with this zygote (its parent), and takes
                # its round over the channel, as a spawned one does.
                store = os.path.join(_HERE, "_c10d_store.py")
                return ["--error-file", "", "--script", store, "--", str(me), "--standby", "3"]
            null = os.open(os.devnull, os.O_RDONLY)
            _become_fork(sock, (wake_r, wake_w), [null, *fds], mark, me, pdeathsig)
            for line in failed:  # in the rank's log, as a standby of its own says it
                sys.stderr.write(line)
            return _take_handoff(3)
        children.add(pid)
        for f in fds:
            os.close(f)
        _zsend(sock, {"op": "forked", "id": rid, "pid": pid})


def _reap_forks(sock: Any, children: set[int]) -> None:
    """Report every fork that has exited, after killing what it left in its process group."""
    while children:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or not info.si_pid:
            return
        pid = info.si_pid
        # Still a zombie: its pid, and so its process group id, is not reused yet.
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _zsend(sock, {"op": "exit", "pid": pid, "code": code})


def _become_fork(
    sock: Any, wake: tuple[int, int], fds: list[int], mark: str, zygote: int, pdeathsig: Any
) -> None:
    """In a fresh fork: `fds` become descriptors 0, 1, ... and nothing of the zygote's stays."""
    import fcntl

    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if pdeathsig is not None:
        pdeathsig.arm(zygote)  # dies with the zygote, which dies with the agent
    sock.close()
    for end in wake:
        os.close(end)
    # Out of the way first, so that no target number is one of the sources.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    for name in os.listdir("/proc/self/fd"):
        n = int(name)
        if n >= len(fds):
            with contextlib.suppress(OSError):
                os.close(n)
    if mark:
        os.environ[_OWN_ENV[1]] = mark
    else:
        os.environ.pop(_OWN_ENV[1], None)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator was seeded once, in the zygote
        with contextlib.suppress(Exception):
            numpy.random.seed()


def main() -> None:
    _die_with_agent()
    faulthandler.enable(all_threads=True)
    if hasattr(faulthandler, "register") and hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID` prints every thread's stack to the rank's stderr log, and the
        # worker runs on: how a stuck worker is looked at without a debugger.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    argv = sys.argv[1:]
    if argv[:1] == ["--standby"]:
        argv = _standby(argv)
    elif argv[:1] == ["--zygote"]:
        argv = _zygote(argv)
    opts = _parse(argv)
    _fix_sys_path(opts)
    if os.environ.get("GELASTIC_TORCH_METRICS"):  # a job with torch_metrics
        channel = _load_sibling("_metric_channel")
        if channel is not None:
            channel.install()
    before = _file_key(opts.error_file) if opts.error_file else None
    try:
        _run(opts)
    except SystemExit as e:
        # Like torch's @record: a deliberate sys.exit(n) writes no error file; the exit code
        # passes through unchanged (0/None is success).
        _worker_end().finish(e.code)
        raise
    except Exception as e:
        # None when nothing of the target ran (`-m missing`, a SyntaxError): then only the
        # exception itself is printed, as python does.
        import traceback

        tb = _user_traceback(e.__traceback__)
        lines = traceback.format_exception(type(e), e, tb)
        after = _file_key(opts.error_file) if opts.error_file else None
        # torch semantics: a file the worker wrote itself (e.g. @record) wins over ours.
        if after is None or after == before:
            _write_error_file(opts.error_file, f"{type(e).__name__}: {e}", "".join(lines))
        # The interpreter prints value.__traceback__, not the tb argument, so trim it there.
        e.__traceback__ = tb
        sys.excepthook(type(e), e, tb)
        _worker_end().finish(1)
        sys.exit(1)
    else:
        _worker_end().finish(0)
    # KeyboardInterrupt and other BaseExceptions propagate: python then exits exactly as it
    # would without us (for SIGINT: by re-raising the signal). torch does not record them.


if __name__ == "__main__":
    main()
