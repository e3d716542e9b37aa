"""A job's logs and pickled arguments on the agent's host are readable by the agent's user only.

Before the fix the agent made the attempt and rank directories with mkdir's default mode and
wrote `args.pkl`, the round marker and the stdout/stderr logs with the process umask (0755 and
0644 under the usual 022): any local user could read a job's output and arguments.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.model import JobSpec
from tests.service.test_workers import TESTS_DIR, Harness, h  # noqa: F401 - h is a fixture

AGENT_FILES = {"args.pkl", "round", "stdout.log", "stderr.log"}


@pytest.fixture
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


async def test_logs_args_and_their_dirs_are_private(h: Harness, usual_umask: None) -> None:  # noqa: F811
    spec = JobSpec(
        entrypoint="workloads.functions:return_dict",
        function_args=pickle.dumps(((5,), {"y": 7})),
        nproc_per_node=2,
        redirects="3",
        cwd=str(TESTS_DIR),
    )
    g, exits = h.group(spec)
    await h.start(g)
    done = await exits.wait(2)
    assert [e.failure for e in done] == [None, None]
    job_dir = h.log_root / "job1"
    seen: set[str] = set()
    for root, _dirs, files in os.walk(job_dir):
        assert stat.S_IMODE(Path(root).lstat().st_mode) == 0o700, root
        for name in files:
            if name in AGENT_FILES:
                seen.add(name)
                path = Path(root) / name
                assert stat.S_IMODE(path.lstat().st_mode) == 0o600, path
    assert seen == AGENT_FILES, seen
