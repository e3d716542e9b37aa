"""A drain's stop of a WorkerGroup, with real worker processes: the notice first, in the file
GELASTIC_PREEMPT_FILE names, then SIGTERM after the time the coordinator gave, unless every
worker left by itself (which is a stop, not a success)."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from pathlib import Path

from client.model import JobSpec
from client.preempt import notice_json
from tests.service.test_workers import DEADLINE, PY, Console, Harness
from tests.service.test_workers import h as h  # the fixture

WAITS_FOR_NOTICE = """
import json, os, signal, sys, time
from client import preempted

def on_term(signum, frame):
    print("SIGTERM with notice" if preempted() else "SIGTERM without notice", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
leave = os.environ.get("LEAVE") == "1"
for _ in range(2400):
    n = preempted()
    if n is not None and leave:
        print("notice " + json.dumps({"node": n.node, "left": n.seconds_left()}), flush=True)
        sys.exit(0)
    time.sleep(0.05)
"""


def notice_file(h: Harness) -> Path:
    (path,) = (h.log_root / "job1").glob("attempt_0/preempt-node0.json")
    return path


async def test_a_worker_that_reads_the_notice_leaves_before_any_sigterm(h: Harness) -> None:
    console = Console()
    script = h.script("waits.py", WAITS_FOR_NOTICE)
    g, exits = h.group(JobSpec(entrypoint=[PY, script], env={"LEAVE": "1"}), console=console)
    await h.start(g)
    await console.wait_for("ready")
    t0 = time.monotonic()
    notice = notice_json(time.time() + 90.0, "node7", "spot reclaim")
    assert await asyncio.wait_for(g.stop_after_notice(30.0, 60.0, notice), DEADLINE) == []
    # Long before the 60 s after which SIGTERM would come: the worker left by itself.
    assert time.monotonic() - t0 < DEADLINE
    (ex,) = exits.items
    assert (ex.exitcode, ex.stopped_by_agent, ex.failure) == (0, True, None)
    said = json.loads(console.text(1).split("notice ", 1)[1].splitlines()[0])
    assert said["node"] == "node7" and 80.0 < said["left"] <= 90.0
    assert "SIGTERM" not in console.text(1)
    path = notice_file(h)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["reason"] == "spot reclaim"


async def test_a_worker_that_stays_gets_sigterm_once_the_notice_time_is_up(h: Harness) -> None:
    console = Console()
    script = h.script("waits.py", WAITS_FOR_NOTICE)
    g, exits = h.group(JobSpec(entrypoint=[PY, script]), console=console)
    await h.start(g)
    await console.wait_for("ready")
    t0 = time.monotonic()
    notice = notice_json(time.time() + 6.0, "node0", "drained")
    assert await asyncio.wait_for(g.stop_after_notice(5.0, 1.0, notice), DEADLINE) == []
    await console.wait_for("SIGTERM with notice")
    assert time.monotonic() - t0 >= 1.0
    (ex,) = exits.items
    assert ex.stopped_by_agent and ex.failure is None
