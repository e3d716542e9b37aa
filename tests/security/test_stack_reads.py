"""The agent's stack reads are bounded whatever py-spy does: its time, its output, and whom it
reads (only the agent's own workers of the round named; a request carries no pid)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import psutil

from client.node_protocol import NodeMsg, StackReply, StackRequest
from client.stacks import MAX_STACK_BYTES
from nodeagent._stacks import StackService, StackTarget, read_stack


def fake(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(0o700)
    return str(path)


def target(tmp_path: Path, python: bool = True) -> StackTarget:
    return StackTarget(0, os.getpid(), tmp_path / "stderr.log", python)


def test_a_py_spy_that_hangs_is_killed_at_the_timeout(tmp_path: Path) -> None:
    py_spy = fake(tmp_path, "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)")
    # Processes of this test run that were there before (a shared etcd, say) are not the read's.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    began = time.monotonic()
    got = read_stack(target(tmp_path), False, 0.5, py_spy)
    assert time.monotonic() - began < 10
    assert got.status == "error" and got.note == "py-spy did not finish within 0.5 s"
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
    ]


def test_what_py_spy_prints_is_cut(tmp_path: Path) -> None:
    py_spy = fake(tmp_path, "import sys\nsys.stdout.write('x' * 5_000_000)")
    got = read_stack(target(tmp_path), False, 20.0, py_spy)
    assert got.status == "ok"
    assert len(got.text.encode()) <= MAX_STACK_BYTES + 64


def test_a_refusal_for_a_worker_without_the_bootstrap_sends_no_signal(tmp_path: Path) -> None:
    py_spy = fake(tmp_path, "import sys\nprint('Permission Denied', file=sys.stderr)\nsys.exit(1)")
    got = read_stack(target(tmp_path, python=False), False, 20.0, py_spy)
    assert got.status == "error"
    assert got.note.startswith("ptrace refused (Permission Denied); not a python worker")


def test_without_py_spy_the_answer_says_so_not_a_refusal(tmp_path: Path) -> None:
    got = read_stack(target(tmp_path, python=False), False, 20.0, None)
    assert got.status == "error"
    assert got.note.startswith("py-spy is not installed on this node; not a python worker")


def test_any_other_failure_is_said_with_its_exit_code(tmp_path: Path) -> None:
    py_spy = fake(tmp_path, "import sys\nprint('Error: no such process')\nsys.exit(3)")
    got = read_stack(target(tmp_path), False, 20.0, py_spy)
    assert (got.status, got.note) == (
        "error",
        "py-spy failed (exit code 3): Error: no such process",
    )


async def test_a_round_the_agent_does_not_run_is_answered_with_an_error() -> None:
    told: list[NodeMsg] = []
    asked: list[tuple[str, int]] = []

    def workers_of(job_id: str, round_: int) -> None:
        asked.append((job_id, round_))
        return None

    svc = StackService("n1", workers_of, told.append, lambda c, n: asyncio.ensure_future(c))
    svc.start(StackRequest(5, "job-x", 2, (0,)))
    assert asked == [("job-x", 2)]
    assert told == [StackReply(5, error="node n1 runs no round 2 of job job-x")]


async def test_a_failing_lookup_is_answered_and_never_ends_the_session() -> None:
    told: list[NodeMsg] = []

    def workers_of(job_id: str, round_: int) -> None:
        raise RuntimeError("boom")

    svc = StackService("n1", workers_of, told.append, lambda c, n: asyncio.ensure_future(c))
    svc.start(StackRequest(6, "job-x", 2))
    assert told == [StackReply(6, error="node n1 failed to read stacks")]
