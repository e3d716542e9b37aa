"""One real GPU (what a single-GPU host can check): NVML finds it and the agent offers it, a
worker sees it by uuid in CUDA_VISIBLE_DEVICES as torch does, two jobs never share it, a GPU
fault quarantines the node, and a forked worker (a job with `preload`, so a fork of a zygote
that imported torch) uses CUDA, which only works when its zygote never initialised it.

Runs where torch sees a GPU and pynvml imports; skips, saying why, elsewhere. One agent offers
GPU 0 (`--gpus 0`). `tests/gpu/run_on_gpu_host.sh` runs it on a GPU host with the host's torch.
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
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    pytest.skip("tests/gpu needs an NVIDIA GPU torch can use", allow_module_level=True)

from client import JobSpec, JobState, NodeInfo  # noqa: E402
from gelastic.local import LocalCluster, poll_until  # noqa: E402
from nodeagent._gpus import FAULT_FILE_ENV  # noqa: E402
from tests.gpu._nvml import nvml_gpus  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "scripts" / "one_gpu_worker.py")
WAIT_S = 120.0
NODE = "gpu-one"


def _nvml() -> tuple[str, list[int]]:
    """(uuid of NVML's GPU 0, pids of the compute processes on it)."""
    return nvml_gpus(pynvml)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("one-gpu")
    c = LocalCluster(nodes=0, workdir=work / "cluster", lease=5.0, heartbeat_interval=0.5)
    with c:
        c.agent_args = ["--gpus", "0"]
        c.env[FAULT_FILE_ENV] = str(work / "fault")
        c.start_agent(NODE)
        yield c
    assert not c.killed, f"processes left behind: {c.killed}"


def _spec(out: Path, hold: Path, **kw: object) -> JobSpec:
    out.mkdir(parents=True, exist_ok=True)
    return JobSpec(
        entrypoint=[sys.executable, WORKER],
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=0,
        env={"OUT_DIR": str(out), "HOLD_FILE": str(hold)},
        **kw,  # type: ignore[arg-type]
    )


def _rank0(out: Path) -> dict[str, object]:
    poll_until(lambda: (out / "rank0.json").exists(), WAIT_S, what=f"{out.name}'s worker")
    return dict(json.loads((out / "rank0.json").read_text()))


def _node(c: LocalCluster) -> NodeInfo:
    return next(n for n in c.client.list_nodes() if n.name == NODE)


def test_nvml_finds_the_gpu_and_the_worker_sees_it_by_uuid_as_torch_does(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    uuid, _ = _nvml()
    node = _node(cluster)
    assert [g.uuid for g in node.gpus] == [uuid] and node.slots == 1
    hold = tmp_path / "hold"
    job = cluster.client.submit(_spec(tmp_path / "a", hold))
    seen = _rank0(tmp_path / "a")
    assert seen["cuda_visible_devices"] == uuid
    assert seen["device_count"] == 1 and seen["sum"] == 4.0
    assert uuid.lower().endswith(str(seen["device_uuid"]).lower()), (uuid, seen)
    # A second job waits: the node's one GPU is the first job's until it ends.
    second = cluster.client.submit(_spec(tmp_path / "b", hold))
    waiting = (JobState.QUEUED, JobState.RENDEZVOUS)
    poll_until(lambda: second.status().state in waiting, WAIT_S, what="b to wait")
    assert _node(cluster).gpus_used == (0,)
    assert not (tmp_path / "b" / "rank0.json").exists()
    hold.touch()
    assert not job.wait(timeout=WAIT_S).is_failed()
    assert _rank0(tmp_path / "b")["cuda_visible_devices"] == uuid
    assert not second.wait(timeout=WAIT_S).is_failed()


def test_a_forked_worker_uses_cuda_because_its_zygote_never_initialised_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    job = cluster.client.submit(_spec(tmp_path / "z", hold, preload=("torch",)))
    seen = _rank0(tmp_path / "z")
    # torch marks a fork of a process that had initialised CUDA as a bad fork, where any
    # CUDA call raises: this worker's sum on the GPU is the proof its zygote had not.
    assert seen["bad_fork"] is False and seen["sum"] == 4.0, seen
    _, pids = _nvml()
    if seen["pid"] in pids:  # NVML shows this PID namespace's pids: the zygote holds no context
        assert seen["parent"] not in pids, (seen, pids)
    hold.touch()
    assert not job.wait(timeout=WAIT_S).is_failed()


def test_a_gpu_fault_quarantines_the_node_and_an_operator_clears_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    hold, out = tmp_path / "hold", tmp_path / "f"
    job = cluster.client.submit(_spec(out, hold, max_restarts=0))
    _rank0(out)
    fault = Path(cluster.env[FAULT_FILE_ENV])
    fault.write_text("ecc 1\n")
    try:
        poll_until(lambda: _node(cluster).state == "quarantined", WAIT_S, what="the quarantine")
        assert "uncorrectable ECC" in _node(cluster).quarantine_reason
        # No other node: the job waits for one, its round's failure an INFRA one.
        waiting = (JobState.QUEUED, JobState.RENDEZVOUS)
        poll_until(lambda: job.status().state in waiting, WAIT_S, what="the failover")
        infra = [f for a in job.attempts() for f in a.failures if f.node == NODE]
        assert infra and all(f.category.value == "INFRA" for f in infra), infra
        cleared = subprocess.run(
            [sys.executable, "-m", "gelastic", "nodes", "--clear-quarantine", NODE],
            env={**cluster.env, **cluster.client_env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert cleared.returncode == 0, cleared.stderr
        assert _node(cluster).state == "live"
        hold.touch()
        assert not job.wait(timeout=WAIT_S).is_failed()
    finally:
        fault.unlink()
