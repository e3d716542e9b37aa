"""The agent checks a function job's main script on its own host before it starts anything:
a `main_path` that is not a regular .py file there is an INPUT failure of every rank, naming
the path; a good one runs the function without the script's `__main__` block."""

from __future__ import annotations

import asyncio
import pickle
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from client.model import RESULT_KEY_BYTES, FailureCategory, JobSpec
from client.results import decode
from tests.service.test_workers import DEADLINE, Harness, wait_gone


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    yield h
    for g in h.groups:
        await asyncio.wait_for(g.close(), DEADLINE)
    await wait_gone(h.pids)


@pytest.mark.parametrize("make", ["missing", "directory"])
async def test_a_main_path_that_is_no_regular_py_file_is_an_input_failure(
    harness: Harness, make: str
) -> None:
    bad = harness.tmp / "launch.py"
    if make == "directory":
        bad.mkdir()
    spec = JobSpec(entrypoint="__main__:train", main_path=str(bad), nproc_per_node=2)
    spec.validate()  # nothing a submit could see: the file is only looked at on the node
    g, exits = harness.group(spec)
    assert await harness.start(g) == {}
    done = await exits.wait(2)
    for e in done:
        assert e.pid == 0 and e.failure is not None
        assert e.failure.category is FailureCategory.INPUT
        assert str(bad) in e.failure.message and "main_path" in e.failure.message, e.failure


async def test_a_function_of_a_main_script_runs_without_its_main_block(harness: Harness) -> None:
    marker = harness.tmp / "main_block_ran"
    script = harness.script(
        "launch.py",
        f"""
        import os
        class Box:
            def __init__(self, v):
                self.v = v
        def train(box, k=0):
            return [__name__, type(box).__name__, box.v, k, int(os.environ["RANK"])]
        if __name__ == "__main__":
            open({str(marker)!r}, "w").close()
        """,
    )
    # What a launcher whose __main__ is that script pickles: a `__main__.Box`.
    launcher = types.ModuleType("__main__")
    exec("class Box:\n    def __init__(self, v):\n        self.v = v\n", launcher.__dict__)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = launcher
    try:
        payload = pickle.dumps(((launcher.Box(5),), {"k": 2}), protocol=4)
    finally:
        sys.modules["__main__"] = saved
    assert b"__main__" in payload
    key = b"k" * RESULT_KEY_BYTES
    spec = JobSpec(
        entrypoint="__main__:train",
        main_path=script,
        function_args=payload,
        result_key=key,
        nproc_per_node=2,
        cwd=str(harness.tmp),
    )
    spec.validate()
    g, exits = harness.group(spec)
    await harness.start(g)
    done = await exits.wait(2)
    for e in done:
        assert e.failure is None, e.failure
        assert e.return_value is not None
        value = decode(e.return_value, key=key, job_id="job1", rank=e.global_rank)
        assert value == ["__mp_main__", "Box", 5, 2, e.global_rank]
    assert not marker.exists()
