"""A multi-role job end to end: a parameter server and trainers in one rendezvous and one gloo
world, ranks checked against torch's own agent, and a failure in one role restarting all roles."""

from __future__ import annotations

import json
from pathlib import Path

from client import JobSpec, Role, WorkerState
from gelastic.local import LocalCluster
from tests._torch_ranks import torch_ranks
from tests.e2e.conftest import PY, script

TIMEOUT = 120


def test_ps_and_trainers_share_one_world_and_restart_together(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    spec = JobSpec(
        roles=(
            Role("ps", [PY, script("multi_role.py")], args=["--ps"], env={"PART": "ps"}),
            Role(
                "trainer",
                [PY, script("multi_role.py")],
                args=["--train"],
                env={"PART": "trainer"},
                nproc_per_node=2,
                min_nodes=1,
                max_nodes=2,
            ),
        ),
        env={"OUT_DIR": str(out), "FAIL_ROLE": "ps", "PART": "job"},
        max_restarts=1,
        last_call_timeout=0,
    )
    job = cluster.client.submit(spec)
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    status = job.status()

    # Two nodes, one group each: the ps (1 worker) and one trainer group (2 workers).
    members = sorted(status.members, key=lambda m: m.group_rank)
    assert sorted((m.role, m.nproc) for m in members) == [("ps", 1), ("trainer", 2)]
    assert status.world_size == 3
    groups = [(m.role, m.nproc) for m in members]
    expected = torch_ranks(groups)

    # Attempt 0 failed in the ps; every role was stopped and restarted: attempt 1 ran everywhere.
    assert [a.attempt for a in result.attempts] == [0, 1]
    (failure,) = result.attempts[0].failures
    assert (failure.role, failure.role_rank, failure.exitcode) == ("ps", 0, 3)
    seen = {
        (a, r): json.loads((out / f"a{a}-rank{r}.json").read_text())
        for a in (0, 1)
        for r in range(3)
    }
    for a in (0, 1):
        for m, workers in zip(members, expected, strict=True):
            for w in workers:
                s = seen[(a, w["RANK"])]
                env = s["env"]
                assert s["sum"] == 3.0  # 0 + 1 + 2 through one gloo all_reduce of all roles
                for key in ("RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE"):
                    assert env[key] == str(w[key]), (a, m.role, key, env)
                assert env["ROLE_NAME"] == m.role == env["PART"]
                assert s["argv"] == (["--ps"] if m.role == "ps" else ["--train"])
                assert env["GROUP_RANK"] == str(m.group_rank)
                assert env["GROUP_WORLD_SIZE"] == "2"
                assert env["LOCAL_WORLD_SIZE"] == str(m.nproc)
                assert env["TORCHELASTIC_RESTART_COUNT"] == str(a)
                assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
                assert env["TORCHELASTIC_RUN_ID"] == job.job_id
                assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # The trainers did not fail, yet they were restarted with the ps: new processes.
    for r in range(3):
        assert seen[(0, r)]["pid"] != seen[(1, r)]["pid"]
    for a in (0, 1):
        assert len({seen[(a, r)]["env"]["MASTER_PORT"] for r in range(3)}) == 1
