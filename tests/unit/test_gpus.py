"""The agent's NVML layer: discovery for `--gpus auto|none|LIST`, and health sampling.

Driven by a fake pynvml module (tests/_fake_nvml.py) with the real module's names; the
"not installed" case goes through the real lazy import with `pynvml` made unimportable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from client.model import JobSpec
from nodeagent._gpus import GpuMonitor, discover_gpus, load_nvml, parse_gpus
from nodeagent.session import AgentConfig
from tests._fake_nvml import FakeNvml


def test_parse_gpus_takes_auto_none_and_a_list() -> None:
    assert parse_gpus("auto") == "auto"
    assert parse_gpus(" None ") == "none"
    assert parse_gpus("0,1,2,3") == (0, 1, 2, 3)
    assert parse_gpus("3") == (3,)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("0,,1", "comma-separated list of GPU indices"),
        ("gpu0", "comma-separated list of GPU indices"),
        ("-1", "comma-separated list of GPU indices"),
        ("0,1,0", "GPU 0 is listed twice"),
        (",".join(str(i) for i in range(65)), "at most 64 GPUs"),
        ("1" * 5000, "comma-separated list"),
    ],
)
def test_a_bad_gpu_list_is_refused_naming_the_problem(text: str, named: str) -> None:
    with pytest.raises(ValueError, match="--gpus") as exc:
        parse_gpus(text)
    assert named in str(exc.value)
    with pytest.raises(ValueError, match=named):
        AgentConfig(coordinator="127.0.0.1:1", gpus=text).validate()


def test_auto_offers_every_gpu_nvml_sees() -> None:
    nvml = FakeNvml(count=4)
    devices, handles, note = discover_gpus("auto", nvml)
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert devices[2].uuid == nvml.gpus[2].uuid
    assert devices[0].name == "NVIDIA A100-SXM4-40GB"
    assert devices[0].memory_total == 40 * 2**30
    assert len(handles) == 4
    assert note.startswith("GPUs: 4 (0=NVIDIA A100")


def test_none_offers_nothing_and_never_touches_nvml() -> None:
    nvml = FakeNvml(count=2)
    assert discover_gpus("none", nvml)[0] == []
    assert not nvml.initialized


def test_a_list_offers_exactly_those_gpus() -> None:
    devices, _, _ = discover_gpus((1, 3), FakeNvml(count=4))
    assert [d.index for d in devices] == [1, 3]


def test_a_list_naming_a_gpu_that_is_not_here_is_refused() -> None:
    with pytest.raises(ValueError, match=r"GPU 5 does not exist on this node \(NVML sees 4: 0-3\)"):
        discover_gpus((0, 5), FakeNvml(count=4))


def test_without_pynvml_auto_means_none_and_a_list_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert load_nvml() is None
    devices, _, note = discover_gpus("auto")
    assert devices == []
    assert "nvidia-ml-py is not installed" in note
    with pytest.raises(ValueError, match="nvidia-ml-py"):
        discover_gpus((0,))


def test_without_a_driver_auto_means_none_with_the_reason() -> None:
    devices, _, note = discover_gpus("auto", FakeNvml(count=2, driver_loaded=False))
    assert devices == []
    assert note == "GPUs: none (NVML is not usable here: Driver Not Loaded)"
    with pytest.raises(ValueError, match="NVML is not usable here: Driver Not Loaded"):
        discover_gpus((0, 1), FakeNvml(count=2, driver_loaded=False))


def test_sampling_reads_utilization_memory_temperature_and_ecc() -> None:
    nvml = FakeNvml(count=2)
    nvml.gpus[1].util, nvml.gpus[1].memory_used, nvml.gpus[1].temperature = 93, 30 * 2**30, 77
    nvml.gpus[1].ecc_uncorrected = 2
    nvml.gpus[0].ecc_supported = False  # a GPU without ECC reports 0, not an error
    devices, handles, _ = discover_gpus("auto", nvml)
    s0, s1 = GpuMonitor(nvml, devices, handles).sample()
    assert (s0.index, s0.uncorrectable_ecc, s0.lost) == (0, 0, False)
    assert (s1.index, s1.utilization_percent, s1.memory_used, s1.temperature_c) == (
        1,
        93.0,
        30 * 2**30,
        77,
    )
    assert s1.uncorrectable_ecc == 2


def test_a_gpu_that_falls_off_the_bus_is_reported_lost_and_stays_lost() -> None:
    nvml = FakeNvml(count=2)
    devices, handles, _ = discover_gpus("auto", nvml)
    monitor = GpuMonitor(nvml, devices, handles)
    assert not any(s.lost for s in monitor.sample())
    nvml.gpus[1].lost = True
    assert [s.lost for s in monitor.sample()] == [False, True]
    nvml.gpus[1].lost = False  # NVML never hands a lost GPU back to this process
    calls = nvml.calls
    assert [s.lost for s in monitor.sample()] == [False, True]
    assert nvml.calls - calls == 4  # the lost GPU is not read again


def test_another_nvml_error_is_not_called_lost() -> None:
    nvml = FakeNvml(count=1)
    devices, handles, _ = discover_gpus("auto", nvml)
    nvml.initialized = False  # every call now fails with NVML_ERROR_UNINITIALIZED
    (s,) = GpuMonitor(nvml, devices, handles).sample()
    assert not s.lost


def _plan_envs(gpus: tuple[int, ...], uuids: tuple[str, ...], user_env: dict[str, str]) -> list:  # type: ignore[type-arg]
    from dataclasses import replace
    from pathlib import Path

    from client.assignment import RoundAssignment, WorkerRanks
    from client.model import JobSpec
    from nodeagent._launch import build_launch_plan

    spec = JobSpec(entrypoint=["/bin/true"], nproc_per_node=2, env=user_env)
    spec.validate()
    a = RoundAssignment(
        job_id="job-7",
        round=1,
        attempt=0,
        spec=spec,
        group_rank=0,
        group_world_size=1,
        master_addr="10.0.0.1",
        master_port=29511,
        workers=tuple(WorkerRanks(i, i, i, 2, 2) for i in range(2)),
        run_id="job-7",
    )
    a = replace(a, gpus=gpus, gpu_uuids=uuids)
    plan = build_launch_plan(
        a, log_root=Path("/logs"), node_name="n0", agent_env={"CUDA_VISIBLE_DEVICES": "7"}
    )
    return [(w.env["LOCAL_RANK"], w.env.get("CUDA_VISIBLE_DEVICES")) for w in plan]


def test_every_worker_of_a_gpu_round_sees_its_gpus_in_local_rank_order() -> None:
    envs = _plan_envs((2, 0), ("GPU-b", "GPU-a"), {"CUDA_VISIBLE_DEVICES": "1"})
    # Device LOCAL_RANK of the list is the GPU placed for that rank; the user's value loses.
    assert envs == [("0", "GPU-b,GPU-a"), ("1", "GPU-b,GPU-a")]


def test_a_node_without_gpus_leaves_cuda_visible_devices_to_the_user_and_the_agent() -> None:
    assert _plan_envs((), (), {"CUDA_VISIBLE_DEVICES": "1"}) == [("0", "1"), ("1", "1")]
    assert _plan_envs((), (), {}) == [("0", "7"), ("1", "7")]


def test_nodeagent_refuses_a_bad_gpus_flag_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from nodeagent.cli import main

    assert main(["--coordinator", "127.0.0.1:1", "--name", "n1", "--gpus", "0,0"]) == 2
    assert "nodeagent: --gpus: GPU 0 is listed twice" in capsys.readouterr().err


def test_the_fault_file_makes_a_gpu_lost_or_adds_an_ecc_error(tmp_path: Path) -> None:
    nvml = FakeNvml(count=2)
    nvml.gpus[0].ecc_uncorrected = 4
    devices, handles, _ = discover_gpus("auto", nvml)
    fault = tmp_path / "fault"
    monitor = GpuMonitor(nvml, devices, handles, fault_file=str(fault))
    assert [s.uncorrectable_ecc for s in monitor.sample()] == [4, 0]  # no file: no fault
    fault.write_text("ecc 0\n")
    assert [s.uncorrectable_ecc for s in monitor.sample()] == [5, 0]
    fault.write_text("rm -rf /")  # not understood: nothing happens
    assert [(s.uncorrectable_ecc, s.lost) for s in monitor.sample()] == [(4, False), (0, False)]
    fault.write_text("lost 1")
    assert [s.lost for s in monitor.sample()] == [False, True]


def test_the_agent_refuses_an_assignment_naming_gpus_it_does_not_offer(tmp_path: Path) -> None:
    from client.model import GpuDevice
    from client.wire import spec_to_pb
    from nodeagent.session import NodeAgent
    from protos.gelastic.v1 import gelastic_pb2 as pb

    agent = NodeAgent(
        AgentConfig(coordinator="127.0.0.1:1", name="n1", addr="127.0.0.1", log_dir=str(tmp_path))
    )
    agent.gpus = [GpuDevice(0, "GPU-a", "A100", 1), GpuDevice(1, "GPU-b", "A100", 1)]
    sent: list[pb.NodeMessage] = []
    agent._send = sent.append  # type: ignore[method-assign]
    spec = spec_to_pb(JobSpec(entrypoint=["true"], nproc_per_node=2))

    def assign(round_: int, gpus: list[int]) -> None:
        agent._assign(
            pb.Assign(
                job_id="job-1",
                round=round_,
                spec=spec,
                workers=[pb.WorkerRanks(local_rank=i, global_rank=i) for i in range(2)],
                gpus=gpus,
                gpu_uuids=["GPU-forged"] * len(gpus),
            )
        )

    assign(1, [0, 7])
    assign(2, [0, 0])
    assign(3, [1])
    messages = [m.worker_exited.exit.failure.message for m in sent]
    assert len(messages) == 6 and not agent._held
    assert "names GPUs [0, 7] but this node offers [0, 1]" in messages[0]
    assert "gives 2 GPUs to 2 workers" in messages[2]
    assert "gives 1 GPUs to 2 workers" in messages[4]
