"""`gelastic logs JOB --all -f` right after submit waits for the ranks, as `-f` does for one.

Before, it exited 1 with `job X has no ranks yet` while the job was still in rendezvous.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from client import JobSpec, cli
from client._client import Job
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, assert_no_leftovers

HELLO = "import os; print('hello from', os.environ['RANK'], flush=True)"


def test_all_ranks_followed_from_before_the_job_has_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # One node of the two the job needs: it stays in rendezvous, with no ranks, until the
    # second agent comes.
    with LocalCluster(nodes=1, slots=1, workdir=tmp_path / "cluster") as c:
        job = c.client.submit(JobSpec(entrypoint=[PY, "-c", HELLO], min_nodes=2, max_nodes=2))
        seen_none = threading.Event()
        status = Job.status

        def watched(self: Job, *a: Any, **kw: Any) -> Any:
            s = status(self, *a, **kw)
            if not s.workers:
                seen_none.set()
            return s

        monkeypatch.setattr(Job, "status", watched)
        codes: list[int] = []
        argv = ["--coordinator", c.address, "--token-file", c.token_file]
        logs = threading.Thread(
            target=lambda: codes.append(cli.main([*argv, "logs", job.job_id, "--all", "-f"])),
            daemon=True,
        )
        logs.start()
        poll_until(seen_none.is_set, 30, what="`gelastic logs` to see a job with no ranks")
        c.start_agent("node-1")
        logs.join(90)
        assert not logs.is_alive(), "gelastic logs -f did not end with the job"
        out, err = capfd.readouterr()
        assert codes == [cli.EXIT_OK], (out, err)
        assert "[0]:hello from 0" in out.splitlines(), (out, err)
        assert "[1]:hello from 1" in out.splitlines(), (out, err)
        assert "no ranks" not in err
    assert_no_leftovers(c)


def test_all_ranks_of_a_job_that_ended_with_none_is_exit_1(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with LocalCluster(nodes=1, slots=1, workdir=tmp_path / "cluster") as c:
        job = c.client.submit(JobSpec(entrypoint=[PY, "-c", HELLO], min_nodes=2, max_nodes=2))
        job.cancel()
        argv = ["--coordinator", c.address, "--token-file", c.token_file]
        code = cli.main([*argv, "logs", job.job_id, "--all", "-f"])
        out, err = capfd.readouterr()
        assert code == cli.EXIT_FAILED, (out, err)
        assert err.strip().endswith(f"job {job.job_id} ended before any rank started"), err
        assert out == ""
    assert_no_leftovers(c)
