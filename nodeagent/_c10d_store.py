"""Serve one round's c10d store: `python _c10d_store.py AGENT_PID LISTEN_FD`.

Group rank 0's agent runs this under the job's own interpreter, env and cwd, just before the
round's workers, when they run with ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a TCPStore
client). It serves a real c10d TCPStore at MASTER_ADDR:MASTER_PORT on the listening socket the
agent bound and handed over as LISTEN_FD, so the port is never free between the agent's bind
and the store; workers that connect before torch is imported here wait in the listen backlog.
The store outlives the workers: the agent stops it after them, so no rank's background threads
lose the store at interpreter exit, which is what happens when rank 0 hosts it.

It tells the agent one line on stdout: ``ready <port>`` once the store serves, or
``no-torch <reason>`` (then exits 0) when this interpreter cannot import torch. It exits on EOF
on stdin (the agent closed its end, or died), on SIGTERM, and when the agent dies
(PR_SET_PDEATHSIG, armed first thing). Standalone: the standard library and torch only; the
agent itself never imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from datetime import timedelta

_HERE = os.path.dirname(os.path.realpath(__file__))
_SELF_CONNECT_TIMEOUT = timedelta(seconds=60)
"""For the server's own client connection to the socket it serves (immediate in practice)."""


def _die_with_agent(parent: int) -> None:
    # The exec stub's code beside this file, loaded by path: nodeagent is not importable here.
    path = os.path.join(_HERE, "_pdeathsig.py")
    spec = importlib.util.spec_from_file_location("_gelastic_pdeathsig", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.arm(parent)


def _exit_on_eof() -> None:
    # Watched from the start, torch import included: an agent gone means this store is useless.
    def wait() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            os._exit(0)

    threading.Thread(target=wait, name="agent-eof", daemon=True).start()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    if len(sys.argv) != 3 or not sys.argv[1].isdigit() or not sys.argv[2].isdigit():
        print("usage: _c10d_store.py AGENT_PID LISTEN_FD", file=sys.stderr)
        os._exit(2)
    _die_with_agent(int(sys.argv[1]))
    _exit_on_eof()
    listen_fd = int(sys.argv[2])
    # Run by path, sys.path[0] is the agent's package directory: not the workers' import path.
    if sys.path and os.path.realpath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    try:
        # By name: torch is the job's dependency, not the agent's (nor its type checker's).
        distributed = importlib.import_module("torch.distributed")
    except ImportError as e:
        _say(f"no-torch {type(e).__name__}: {e}")
        os._exit(0)
    store = distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=None,
        is_master=True,
        timeout=_SELF_CONNECT_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )
    _say(f"ready {store.port}")
    # Serve until the agent says stop (EOF), SIGTERM or the agent's death end the process.
    threading.Event().wait()


if __name__ == "__main__":
    main()
