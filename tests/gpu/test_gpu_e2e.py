"""Real GPUs, real NCCL: every job gets its own GPU pair, its workers find their devices at
LOCAL_RANK, and a GPU fault quarantines the node, moves its job off it, and is cleared.

Runs where `torch.cuda.device_count() >= 2` and pynvml imports; skips, saying why, elsewhere
(`make test` does not even collect it without an NVIDIA GPU; `make test-gpu` runs it).
One agent per GPU pair on this host (`--gpus 0,1`, `--gpus 2,3`), at most two pairs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="tests/gpu needs torch")
pynvml = pytest.importorskip("pynvml", reason="tests/gpu needs nvidia-ml-py (pip install '.[gpu]')")
if torch.cuda.device_count() < 2:
    pytest.skip(
        f"tests/gpu needs at least 2 NVIDIA GPUs; torch sees {torch.cuda.device_count()}",
        allow_module_level=True,
    )
if not torch.distributed.is_nccl_available():
    pytest.skip("tests/gpu needs a torch build with NCCL", allow_module_level=True)

from client import JobSpec, JobState, NodeInfo  # noqa: E402
from gelastic.local import LocalCluster, poll_until  # noqa: E402
from nodeagent._gpus import FAULT_FILE_ENV  # noqa: E402
from tests.gpu._nvml import nvml_gpus  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "scripts" / "nccl_worker.py")
PAIRS = min(2, torch.cuda.device_count() // 2)
WAIT_S = 180.0


def _nvml_uuids() -> list[str]:
    return [uuid for uuid, _ in nvml_gpus(pynvml)]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("gpu-cluster")
    c = LocalCluster(nodes=0, workdir=work / "cluster", lease=5.0, heartbeat_interval=0.5)
    with c:
        for p in range(PAIRS):
            c.agent_args = ["--gpus", f"{2 * p},{2 * p + 1}"]
            c.env[FAULT_FILE_ENV] = str(work / f"fault-gpu-{p}")
            c.start_agent(f"gpu-{p}")
        yield c
    assert not c.killed, f"processes left behind: {c.killed}"


def _spec(out: Path, hold: Path) -> JobSpec:
    out.mkdir(parents=True, exist_ok=True)
    return JobSpec(
        entrypoint=[sys.executable, WORKER],
        nproc_per_node=2,
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=0,
        max_restarts=0,
        env={"OUT_DIR": str(out), "HOLD_FILE": str(hold)},
    )


def _ranks(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_every_job_gets_its_own_gpu_pair_and_nccl_all_reduce_works(
    gpu_cluster: LocalCluster, tmp_path: Path
) -> None:
    client = gpu_cluster.client
    uuids = _nvml_uuids()
    hold = tmp_path / "hold"
    jobs = {}
    for p in range(PAIRS):
        out = tmp_path / f"job{p}"
        jobs[p] = (client.submit(_spec(out, hold)), out)
    for _job, out in jobs.values():
        poll_until(lambda out=out: all((out / f"rank{r}.json").exists() for r in (0, 1)), WAIT_S)
    held: dict[str, set[str]] = {}
    for job, out in jobs.values():
        status = job.status()
        (member,) = status.members
        ranks = _ranks(out)
        node_gpus = uuids[2 * int(member.node.split("-")[1]) :][:2]
        for r in ranks:
            assert r["sum"] == 3.0  # 1 + 2 over NCCL
            assert r["cuda_visible_devices"] == ",".join(node_gpus)
            assert r["device_count"] == 2
            mine = node_gpus[int(str(r["local_rank"]))]
            assert mine.lower().endswith(str(r["device_uuid"]).lower()), (mine, r)
        shown = {w.gpu.uuid for w in status.workers if w.gpu is not None}
        assert shown == set(node_gpus)
        held[job.job_id] = shown
    all_held = [u for s in held.values() for u in s]
    assert len(all_held) == len(set(all_held)) == 2 * PAIRS  # never shared
    hold.touch()
    for job, _ in jobs.values():
        result = job.wait(timeout=WAIT_S)
        assert not result.is_failed(), result


def test_a_gpu_fault_quarantines_the_node_fails_its_job_over_and_an_operator_clears_it(
    gpu_cluster: LocalCluster, tmp_path: Path
) -> None:
    client = gpu_cluster.client
    hold, out = tmp_path / "hold", tmp_path / "job"
    job = client.submit(_spec(out, hold))
    poll_until(lambda: all((out / f"rank{r}.json").exists() for r in (0, 1)), WAIT_S)
    (first,) = job.status().members
    fault = Path(gpu_cluster.env[FAULT_FILE_ENV]).with_name(f"fault-{first.node}")
    for r in (0, 1):
        (out / f"rank{r}.json").unlink()
    fault.write_text("ecc 1\n")

    def node(name: str) -> NodeInfo:
        return next(n for n in client.list_nodes() if n.name == name)

    poll_until(lambda: node(first.node).state == "quarantined", WAIT_S, what="the quarantine")
    assert "uncorrectable ECC" in node(first.node).quarantine_reason
    poll_until(lambda: job.status().round > 1 or job.status().state == JobState.QUEUED, WAIT_S)
    status = job.status()
    assert status.attempt == 0  # a failover, not a restart
    assert first.node not in {m.node for m in status.members}
    infra = [f for a in job.attempts() for f in a.failures if f.node == first.node]
    assert infra and all(f.category.value == "INFRA" for f in infra), infra
    assert "quarantined" in infra[0].message
    if PAIRS > 1:
        poll_until(lambda: all((out / f"rank{r}.json").exists() for r in (0, 1)), WAIT_S)
    cleared = subprocess.run(
        [sys.executable, "-m", "gelastic", "nodes", "--clear-quarantine", first.node],
        env={**gpu_cluster.env, **gpu_cluster.client_env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cleared.returncode == 0, cleared.stderr
    assert f"{first.node}: quarantine cleared" in cleared.stdout
    assert node(first.node).state == "live"
    hold.touch()
    result = job.wait(timeout=WAIT_S)
    assert not result.is_failed(), result
    fault.unlink()
