"""Worker marks of forked workers: a fork's exit sweeps what it started, never a sibling.

A real sentinel and zygote (no agent): /proc/PID/environ of every fork shows the zygote's
environment, so each fork carries a mark of its own in os.environ (what it execs inherits it)
and is told to the sentinel with that mark.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from nodeagent._process import Sentinel
from nodeagent._zygote import Zygote
from tests._helpers import gone, wait_for
from tests.unit.test_zygote import _launch

WAIT_S = 20.0

# Starts a child in its session and one that leaves it (setsid), records them, exits 3.
PARENT = """
import json, os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
inside = subprocess.Popen(sleep)
outside = subprocess.Popen(sleep, start_new_session=True)
with open(os.environ["OUT"], "w") as f:
    json.dump([inside.pid, outside.pid], f)
sys.exit(3)
"""
SIBLING = """
import os, time
open(os.environ["OUT"], "w").write(str(os.getpid()))
time.sleep(120)
"""


def test_a_forked_workers_exit_sweeps_its_own_children_and_never_a_sibling(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        sentinel = Sentinel()
        sentinel.start()
        z = Zygote.start(_launch(tmp_path))
        try:
            assert await z.wait_ready(60)
            jobs = {"parent": PARENT, "sibling": SIBLING}
            forks = {}
            for name, code in jobs.items():
                handle, wfd = await z.fork()
                for fd in handle.take_pipes():
                    assert fd is not None
                    os.close(fd)
                env = {"PATH": os.environ.get("PATH", ""), "OUT": str(tmp_path / name)}
                os.write(wfd, json.dumps({"argv": ["--code", code], "env": env}).encode())
                os.close(wfd)
                forks[name] = handle
            assert await asyncio.wait_for(forks["parent"].wait(), 30) == 3
            children = json.loads((tmp_path / "parent").read_text())
            await wait_for(
                lambda: (tmp_path / "sibling").exists(), WAIT_S, what="the sibling to start"
            )
            # Both of its children go: one in its session, one by its mark across setsid.
            await wait_for(
                lambda: all(gone(c) for c in children), WAIT_S, what="the fork's children to go"
            )
            sibling = forks["sibling"]
            assert sibling.is_alive() and not gone(sibling.pid)
            assert int((tmp_path / "sibling").read_text()) == sibling.pid
        finally:
            z.kill()
            await asyncio.wait_for(z.handle.wait(), 10)
            z.close()
            await sentinel.stop()

    asyncio.run(main())
