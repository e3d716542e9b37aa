"""Serve one round's c10d store: `python [-S] _c10d_store.py [--site] AGENT_PID LISTEN_FD`.

Warm (`_c10d_store.py AGENT_PID --standby CHANNEL_FD`): torch is imported first, then the round's
MASTER_ADDR/PORT (JSON) and the listening socket (SCM_RIGHTS) come over the inherited unix
socket CHANNEL_FD whose other end only the agent holds; it then serves as below.

Group rank 0's agent runs this under the job's own interpreter, env and cwd, right after the
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

The agent starts it beside the round's workers, so it keeps out of their way: started with -S
and `--site`, it runs `site` (the .pth files) in the same thread of the lowest priority that
then imports torch; only the bare interpreter's start and the store's service run at normal
priority.
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import json
import os
import socket
import sys
import threading
from datetime import timedelta
from typing import Any

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


IMPORT_NICE = 19
"""The niceness of the thread that imports torch: the lowest priority there is."""


def _import_torch_distributed(site_later: bool) -> tuple[Any, str]:
    """torch.distributed, and "" (or None, and why it cannot be imported); with `site_later`
    (started with -S by the agent) `site` is run first, in the same low-priority thread.

    Imported in a thread of the lowest priority: the round's workers start at the same moment
    and come first for the CPU; once they wait on the store (in the listen backlog) or are busy
    importing torch themselves, the CPU is theirs or this thread's alike, so the store is not
    later for it. The niceness is the thread's own (Linux): the store is created, and served by
    its own thread, at the host's normal priority.
    """
    found: list[tuple[Any, str]] = []

    def run() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICE)
        if site_later:
            import site

            site.main()
        try:
            # By name: torch is the job's dependency, not the agent's (nor its type checker's).
            found.append((importlib.import_module("torch.distributed"), ""))
        except ImportError as e:
            found.append((None, f"{type(e).__name__}: {e}"))

    thread = threading.Thread(target=run, name="import-torch")
    thread.start()
    thread.join()
    if not found:  # the import raised something else: it was printed on stderr
        os._exit(1)
    return found[0]


_MAX_HANDOFF = 65536
_HANDOFF_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GELASTIC_JOB_ID",
    "GELASTIC_ROUND",
    "GELASTIC_NODE",
)


def _handoff(channel_fd: int) -> int:
    """A warm host: the round's env (JSON) and its listening socket, from the agent only."""
    chan = socket.socket(fileno=channel_fd)
    msg, ancdata, _, _ = chan.recvmsg(
        _MAX_HANDOFF, socket.CMSG_SPACE(array.array("i", [0]).itemsize)
    )
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    chan.close()
    if not msg:
        os._exit(0)  # let go unused
    env = json.loads(msg.decode("utf-8"))
    if len(fds) != 1 or not isinstance(env, dict):
        print("bad store host hand-off", file=sys.stderr)
        os._exit(2)
    for key in _HANDOFF_ENV:
        value = env.get(key)
        if isinstance(value, str) and "\x00" not in value:
            os.environ[key] = value
    return int(fds[0])


def main() -> None:
    site_later = sys.argv[1:2] == ["--site"] and bool(sys.flags.no_site)
    if sys.argv[1:2] == ["--site"]:
        del sys.argv[1]
    standby = len(sys.argv) == 4 and sys.argv[2] == "--standby" and sys.argv[3].isdigit()
    if not standby and (
        len(sys.argv) != 3 or not sys.argv[1].isdigit() or not sys.argv[2].isdigit()
    ):
        print("usage: _c10d_store.py AGENT_PID (LISTEN_FD | --standby CHANNEL_FD)", file=sys.stderr)
        os._exit(2)
    _die_with_agent(int(sys.argv[1]))
    _exit_on_eof()
    # Run by path, sys.path[0] is the agent's package directory: not the workers' import path.
    if sys.path and os.path.realpath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    distributed, no_torch = _import_torch_distributed(site_later)
    listen_fd = _handoff(int(sys.argv[3])) if standby else int(sys.argv[2])
    if no_torch:
        _say(f"no-torch {no_torch}")
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
