"""WorkerGroup reports a failure when the worker records it, before the worker exits.

Real worker processes: each writes its error file and then waits for the test's go-ahead (a
file), so the notice is observed while the process provably still runs.
"""

from __future__ import annotations

import asyncio
import json

from client.model import JobSpec, ProcessFailure
from tests._helpers import wait_for

from .test_workers import DEADLINE, PY, Harness, gone, h

__all__ = ["h"]

_WRITER = """
import json, os, sys, time
path = os.environ["TORCHELASTIC_ERROR_FILE"]
def write(message):
    # As torch's @record does: one json.dump in one open(..., "w").
    with open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback: " + message, "timestamp": str(int(time.time()))}}}, f)
write("ValueError: first")
go = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
if len(sys.argv) > 2:
    write("ValueError: second")  # written again: the first complete record stands
sys.exit(3)
"""


class Failing:
    def __init__(self) -> None:
        self.items: list[ProcessFailure] = []
        self.changed = asyncio.Event()

    def __call__(self, f: ProcessFailure) -> None:
        self.items.append(f)
        self.changed.set()


async def test_the_failure_is_reported_while_the_worker_runs_and_the_exit_completes_it(
    h: Harness,
) -> None:
    script = h.script("writer.py", _WRITER)
    go = h.tmp / "go"
    failing = Failing()
    g, exits = h.group(
        JobSpec(entrypoint=[PY, script], args=[str(go), "again"]), on_failing=failing
    )
    pids = await h.start(g)
    await asyncio.wait_for(failing.changed.wait(), DEADLINE)
    (f,) = failing.items
    assert not gone(pids[0]) and exits.items == []
    assert (f.message, f.executable, f.pid, f.global_rank, f.local_rank) == (
        "ValueError: first",
        PY,
        pids[0],
        0,
        0,
    )
    assert f.traceback == "Traceback: ValueError: first"
    go.write_text("")
    (ex,) = await exits.wait(1)
    assert ex.failure is not None and ex.exitcode == 3 and not ex.stopped_by_agent
    assert (ex.failure.message, ex.failure.executable) == ("ValueError: first", PY)
    assert ex.failure.exitcode == 3
    assert len(failing.items) == 1  # the second write is not a second report


async def test_a_stop_leaves_a_worker_that_recorded_its_failure_to_end_on_its_own(
    h: Harness,
) -> None:
    script = h.script("writer.py", _WRITER)
    go = h.tmp / "go"
    failing = Failing()
    g, exits = h.group(JobSpec(entrypoint=[PY, script], args=[str(go)]), on_failing=failing)
    await h.start(g)
    await asyncio.wait_for(failing.changed.wait(), DEADLINE)
    stopping = asyncio.ensure_future(g.stop(5.0))
    # The stop is under way and the worker is still running: it was not signalled.
    await asyncio.sleep(0)
    assert not stopping.done()
    go.touch()  # now it ends, with its own code
    await asyncio.wait_for(stopping, DEADLINE)
    (ex,) = await exits.wait(1)
    assert not ex.stopped_by_agent and ex.failure is not None
    assert ex.exitcode == 3 and ex.failure.signal == ""
    assert (ex.failure.message, ex.failure.executable) == ("ValueError: first", PY)


async def test_a_worker_that_recorded_its_failure_and_never_ends_is_killed_at_the_grace(
    h: Harness,
) -> None:
    script = h.script("writer.py", _WRITER)
    failing = Failing()
    g, exits = h.group(
        JobSpec(entrypoint=[PY, script], args=[str(h.tmp / "never")], stop_grace=0.5),
        on_failing=failing,
    )
    await h.start(g)
    await asyncio.wait_for(failing.changed.wait(), DEADLINE)
    await asyncio.wait_for(g.stop(0.5), DEADLINE)
    (ex,) = await exits.wait(1)
    # Past the bound it is killed; it is still the failure it recorded, not a stop.
    assert not ex.stopped_by_agent and ex.failure is not None
    assert ex.exitcode == -9 and ex.failure.signal == "SIGKILL"
    assert (ex.failure.message, ex.failure.executable) == ("ValueError: first", PY)


async def test_without_a_failing_callback_nothing_is_watched(h: Harness) -> None:
    script = h.script("writer.py", _WRITER)
    go = h.tmp / "go"
    g, exits = h.group(JobSpec(entrypoint=[PY, script], args=[str(go)]))
    await h.start(g)
    err = h.log_root / "job1" / "attempt_0" / "0" / "error.json"
    await wait_for(err.exists, DEADLINE, what="the error file")
    go.write_text("")
    (ex,) = await exits.wait(1)
    assert ex.failure is not None and (ex.failure.message, ex.failure.executable) == (
        "ValueError: first",
        PY,
    )
    assert json.loads(err.read_text())["message"]["message"] == "ValueError: first"
    assert g._error_watch is None
