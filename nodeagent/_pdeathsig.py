"""Run a program that dies with its agent: `python -S -I _pdeathsig.py AGENT_PID -- PROG ARGS...`.

Sets PR_SET_PDEATHSIG (SIGKILL), checks the agent is still its parent (the agent may have died
before that took effect), then execs the program in place, so the pid stays the worker's. Doing
this here rather than in a `preexec_fn` keeps Python code out of the window between fork and exec
in the multi-threaded agent. The signal reaches only the worker itself; what the worker starts
is killed by the agent's sentinel (`_sentinel.py`). Standalone: standard library only.
"""

import ctypes
import os
import signal
import sys
import time


def arm(parent: int) -> None:
    """Die with `parent`: SIGKILL when it exits. A no-op where prctl is missing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _fail(program: str, err: OSError) -> None:
    code = 127 if isinstance(err, FileNotFoundError) else 126
    message = f"cannot execute {program!r}: {err.strerror}"
    print(message, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # Here only: every python worker loads this module first thing (`arm`), and json
        # brings re with it, milliseconds of each worker's start.
        import json

        try:
            with open(path, "w") as f:
                json.dump({"message": message, "timestamp": time.time()}, f)
        except OSError:
            pass
    os._exit(code)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print("usage: _pdeathsig.py AGENT_PID -- PROGRAM [ARGS...]", file=sys.stderr)
        os._exit(2)
    arm(int(sys.argv[1]))
    argv = sys.argv[3:]
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        _fail(argv[0], err)


if __name__ == "__main__":
    main()
