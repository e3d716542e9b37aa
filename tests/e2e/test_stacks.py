"""Every rank's stack, on demand, from real workers: py-spy through each node's agent, the
faulthandler fallback where ptrace is refused, and the captures the job keeps after its end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from client import JobSpec, JobState
from client.stacks import MAX_STACK_BYTES, StackCapture
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, script

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60


def gelastic(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GELASTIC_COORDINATOR"}
    env["GELASTIC_TOKEN_FILE"] = cluster.token_file
    return subprocess.run(
        [PY, "-m", "gelastic", "--coordinator", cluster.address, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=REPO,
    )


def start(cluster: LocalCluster, out: Path, entry: str, **env: str) -> str:
    """Submit a 2x2 job of `entry`; return its id once every rank touched its ready file."""
    spec = JobSpec(
        entrypoint=[PY, script(entry)],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), **env},
    )
    job = cluster.client.submit(spec)
    poll_until(
        lambda: all((out / f"ready-{r}").exists() for r in range(4)),
        TIMEOUT,
        what="every rank at its spot",
    )
    return job.job_id


def end(cluster: LocalCluster, job_id: str) -> None:
    cluster.client.cancel(job_id)
    poll_until(
        lambda: cluster.client.job(job_id).status().state.is_terminal(),
        TIMEOUT,
        what="the job to end",
    )


def sleep_line(name: str, nth: int = 1) -> int:
    """The line number of the `nth` time.sleep call in script `name`."""
    lines = Path(script(name)).read_text().splitlines()
    return [i for i, line in enumerate(lines, 1) if "time.sleep(" in line][nth - 1]


def ranks_by_group(c: StackCapture) -> list[tuple[int, ...]]:
    return [g.ranks for g in c.groups]


def test_stack_of_a_2x2_job_groups_identical_ranks_odd_one_first(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    job_id = start(cluster, tmp_path, "stack_spots.py", ODD_RANK="2")
    proc = gelastic(cluster, "stack", job_id, "--json")
    assert proc.returncode == 0, proc.stderr
    c = json.loads(proc.stdout)
    assert [g["ranks"] for g in c["groups"]] == [[2], [0, 1, 3]], proc.stdout
    odd, rest = c["groups"]
    assert odd["status"] == rest["status"] == "ok", c
    assert "gelastic_stack_odd_one_out" in odd["text"]
    assert "gelastic_stack_probe_wait" not in odd["text"]
    assert "gelastic_stack_probe_wait" in rest["text"]
    assert f"(stack_spots.py:{sleep_line('stack_spots.py', 1)})" in rest["text"]
    assert f"(stack_spots.py:{sleep_line('stack_spots.py', 2)})" in odd["text"]
    assert odd["nodes"] == ["node-1"] and rest["nodes"] == ["node-0", "node-1"]

    one = cluster.client.capture_stacks(job_id, rank=3)
    assert ranks_by_group(one) == [(3,)]
    assert "gelastic_stack_probe_wait" in one.groups[0].text

    text = gelastic(cluster, "stack", job_id)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines.index("rank 2 (node-1):") < lines.index("ranks 0,1,3 (node-0, node-1):")

    events = [e for e in cluster.client.events(job_id) if e.kind == "stacks"]
    assert len(events) == 3
    assert c["capture_id"] in events[0].reason
    end(cluster, job_id)
    # Kept with the job after its workers are gone.
    last = gelastic(cluster, "stack", job_id, "--last")
    assert last.returncode == 0, last.stderr
    assert last.stdout.splitlines()[2:] == lines[2:]
    # The latest two of the three captures are kept: the one of rank 3, then the last one.
    kept = cluster.client.stacks(job_id)
    assert [k.capture_id for k in kept] == [one.capture_id, kept[-1].capture_id]
    assert kept[-1].capture_id in events[-1].reason and c["capture_id"] not in events[-1].reason
    assert gelastic(cluster, "stack", job_id).returncode == 2  # no worker runs to ask


def test_torch_rank_asleep_while_the_others_wait_in_all_reduce(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    job_id = start(cluster, tmp_path, "stack_allreduce.py", SLOW_RANK="2")
    # The ready files come just before the collective: wait until the three are inside it.
    found: list[StackCapture] = []

    def settled() -> bool:
        found[:] = [cluster.client.capture_stacks(job_id)]
        return ranks_by_group(found[0]) == [(2,), (0, 1, 3)] and all(
            "all_reduce" in g.text for g in found[0].groups[1:]
        )

    poll_until(settled, TIMEOUT, interval=0.5, what="ranks 0,1,3 in all_reduce")
    sleeper, waiting = found[0].groups
    # py-spy shows python frames: the sleeper stands on the script's line of time.sleep.
    assert f"(stack_allreduce.py:{sleep_line('stack_allreduce.py')})" in sleeper.text
    assert "all_reduce" not in sleeper.text
    assert "all_reduce" in waiting.text
    end(cluster, job_id)


def fake_py_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-py-spy"
    path.write_text(f"#!{PY}\n{body}\n")
    path.chmod(0o700)
    return str(path)


REFUSED = """import sys
print("Error: Operation not permitted (os error 1)", file=sys.stderr)
print("Permission Denied: Try running again with elevated permissions", file=sys.stderr)
sys.exit(1)"""


def test_ptrace_refused_falls_back_to_faulthandler_in_the_worker_log(
    make_cluster: object, tmp_path: Path
) -> None:
    cluster = make_cluster(env={"GELASTIC_PY_SPY": fake_py_spy(tmp_path, REFUSED)})  # type: ignore[operator]
    out = tmp_path / "out"
    out.mkdir()
    job_id = start(cluster, out, "stack_spots.py", ODD_RANK="1")
    proc = gelastic(cluster, "stack", job_id)
    assert proc.returncode == 0, proc.stderr
    assert "ptrace refused (Error: Operation not permitted (os error 1))" in proc.stdout
    assert "the stack was written to the worker's log" in proc.stdout
    c = cluster.client.stacks(job_id)[-1]
    assert {g.status for g in c.groups} == {"ptrace_refused"}
    by_rank = {r: g for g in c.groups for r in g.ranks}
    assert "in gelastic_stack_odd_one_out" in by_rank[1].text
    for r in (0, 2, 3):
        assert "in gelastic_stack_probe_wait" in by_rank[r].text
    # The worker wrote it to its own log, and runs on.
    log = b"".join(cluster.client.job(job_id).logs(rank=1, stream="stderr"))
    assert b"in gelastic_stack_odd_one_out" in log
    assert not cluster.client.job(job_id).status().state.is_terminal()
    end(cluster, job_id)


HUGE = """import sys
print("Thread 7 (idle): \\"MainThread\\"")
for i in range(20000):
    print(f"    frame_{i} (deep.py:{i})")"""


def test_a_huge_stack_is_cut_and_stays_readable_after_the_job(
    make_cluster: object, tmp_path: Path
) -> None:
    cluster = make_cluster(env={"GELASTIC_PY_SPY": fake_py_spy(tmp_path, HUGE)})  # type: ignore[operator]
    out = tmp_path / "out"
    out.mkdir()
    job_id = start(cluster, out, "stack_spots.py")
    c = cluster.client.capture_stacks(job_id)
    assert ranks_by_group(c) == [(0, 1, 2, 3)], c
    text = c.groups[0].text
    assert text.startswith('Thread "MainThread"\n    frame_0 (deep.py:0)')
    assert len(text.encode()) <= MAX_STACK_BYTES + 100
    assert text.endswith(f"(cut at {MAX_STACK_BYTES} bytes)")
    end(cluster, job_id)
    assert cluster.client.job(job_id).status().state == JobState.CANCELED
    kept = cluster.client.stacks(job_id)
    assert [k.capture_id for k in kept] == [c.capture_id]
    assert kept[0].groups[0].text == text
