"""GPU placement and quarantine in the coordinator's state machine (fake clock, fake nodes)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from client.model import FailureCategory, GpuDevice, GpuHealth, JobState
from client.node_protocol import Heartbeat
from coordinator._cluster import (
    AssignRound,
    ClusterConfig,
    Effect,
    NodeChanged,
    RunningGroupReport,
    StopRound,
)

from ._cluster_driver import Driver, of_type
from .test_cluster import _NAMES, ClusterHistories


def gpus(node: str, n: int) -> list[GpuDevice]:
    return [GpuDevice(i, f"GPU-{node}-{i}", "A100", 40 * 2**30) for i in range(n)]


def gpu_driver(nodes: int = 2, per_node: int = 4, **config: float) -> Driver:
    d = Driver(ClusterConfig(heartbeat_interval=1.0, lease=5.0, **config))  # type: ignore[arg-type]
    for i in range(nodes):
        d.connect(f"n{i}", addr=f"10.0.0.{i + 1}", slots=per_node, gpus=gpus(f"n{i}", per_node))
    return d


def assigns(d: Driver, job: str) -> dict[str, AssignRound]:
    return {a.node: a for a in of_type(d.history, AssignRound) if a.assignment.job_id == job}


def beat(d: Driver, node: str, *samples: GpuHealth) -> None:
    n = d.nodes[node]
    d._take(d.cluster.step(node, n.incarnation, Heartbeat(gpus=tuple(samples)), d.now))


def test_two_jobs_on_one_node_get_disjoint_gpus_and_free_them_when_done() -> None:
    d = gpu_driver(nodes=1, per_node=4)
    for job in ("a", "b"):
        d.submit(job, nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
        d.settle()
    a, b = assigns(d, "a")["n0"].assignment, assigns(d, "b")["n0"].assignment
    assert a.gpus == (0, 1) and b.gpus == (2, 3)
    assert a.gpu_uuids == ("GPU-n0-0", "GPU-n0-1")
    # A third job finds no free GPU (nor slot) and waits.
    d.submit("c", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("c") == JobState.QUEUED
    (node,) = d.cluster.nodes()
    assert node.gpus_used == (0, 1, 2, 3)
    d.finish("n0", "a")
    d.settle()
    assert d.state("a") == JobState.SUCCEEDED
    assert assigns(d, "c")["n0"].assignment.gpus == (0,)


def test_more_slots_than_gpus_still_gives_each_worker_its_own_gpu() -> None:
    d = Driver()
    d.connect("n0", slots=8, gpus=gpus("n0", 2))
    d.submit("a", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.submit("b", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert assigns(d, "a")["n0"].assignment.gpus == (0, 1)
    assert d.state("b") == JobState.QUEUED
    assert "b" not in assigns(d, "b") and not assigns(d, "b")


def test_a_node_without_gpus_gets_no_gpus_in_its_assignment() -> None:
    d = Driver()
    d.connect("n0", slots=2)
    d.submit("a", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    a = assigns(d, "a")["n0"].assignment
    assert a.gpus == () and a.gpu_uuids == ()
    assert all(w.gpu is None for w in d.cluster.job_status("a").workers)


def test_status_shows_each_rank_its_gpu_and_latest_sample() -> None:
    d = gpu_driver(nodes=1, per_node=2)
    d.submit("a", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    beat(d, "n0", GpuHealth(0, 55.0, 3 * 2**30, 61), GpuHealth(1, 12.0, 2**30, 40))
    w0, w1 = d.cluster.job_status("a").workers
    assert w0.gpu is not None and w1.gpu is not None
    assert (w0.gpu.index, w0.gpu.uuid, w0.gpu.utilization_percent) == (0, "GPU-n0-0", 55.0)
    assert (w0.gpu.memory_used, w0.gpu.memory_total, w0.gpu.temperature_c) == (
        3 * 2**30,
        40 * 2**30,
        61,
    )
    assert (w1.gpu.index, w1.gpu.temperature_c) == (1, 40)


def test_new_uncorrectable_errors_quarantine_the_node_and_fail_its_round_over() -> None:
    d = gpu_driver(nodes=3, per_node=2)
    d.submit("j", nproc_per_node=2, min_nodes=2, max_nodes=2, last_call_timeout=0.0)
    d.settle()
    assert set(assigns(d, "j")) == {"n0", "n1"}
    beat(d, "n1", GpuHealth(0), GpuHealth(1, uncorrectable_ecc=3))
    effects = d.settle()
    (node,) = [n for n in d.cluster.nodes() if n.name == "n1"]
    assert node.state == "quarantined"
    assert "GPU 1 (GPU-n1-1) has 3 uncorrectable ECC errors" in node.quarantine_reason
    assert node.quarantined_until == d.now + 3600.0
    assert any(isinstance(e, NodeChanged) and e.node == "n1" for e in d.history)
    assert any(isinstance(e, StopRound) and e.node == "n1" for e in effects)
    # Re-formed without it and without spending the restart budget.
    status = d.cluster.job_status("j")
    assert status.state == JobState.RUNNING and status.attempt == 0 and status.round == 2
    assert {m.node for m in status.members} == {"n0", "n2"}
    (attempt,) = d.cluster.job_attempts("j")
    lost = [f for f in attempt.failures if f.node == "n1"]
    assert lost and all(f.category == FailureCategory.INFRA for f in lost)
    assert "quarantined" in lost[0].message


def test_a_lost_gpu_quarantines_the_node_and_no_new_round_goes_there() -> None:
    d = gpu_driver(nodes=1, per_node=2)
    beat(d, "n0", GpuHealth(0), GpuHealth(1, lost=True))
    (node,) = d.cluster.nodes()
    assert node.state == "quarantined" and "GPU 1 (GPU-n0-1) is lost" in node.quarantine_reason
    d.submit("j", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.QUEUED and not assigns(d, "j")


def test_the_quarantine_ends_when_its_ttl_passes() -> None:
    d = gpu_driver(nodes=1, per_node=1, quarantine_ttl=60.0)
    beat(d, "n0", GpuHealth(0, uncorrectable_ecc=1))
    d.submit("j", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.advance(30)
    d.settle()
    assert d.cluster.nodes()[0].state == "quarantined" and not assigns(d, "j")
    d.advance(31)
    d.settle()
    assert d.cluster.nodes()[0].state == "live"
    assert assigns(d, "j")["n0"].assignment.gpus == (0,)


def test_an_operator_clear_accepts_the_count_and_only_a_new_error_quarantines_again() -> None:
    d = gpu_driver(nodes=1, per_node=1)
    beat(d, "n0", GpuHealth(0, uncorrectable_ecc=2))
    assert d.cluster.nodes()[0].state == "quarantined"
    cleared, _ = d.cluster.clear_quarantine("n0", d.now)
    assert cleared
    assert d.cluster.clear_quarantine("n0", d.now)[0] is False  # nothing left to clear
    assert d.cluster.clear_quarantine("nobody", d.now)[0] is False
    beat(d, "n0", GpuHealth(0, uncorrectable_ecc=2))
    assert d.cluster.nodes()[0].state == "live"
    beat(d, "n0", GpuHealth(0, uncorrectable_ecc=3))
    assert d.cluster.nodes()[0].state == "quarantined"


def test_a_quarantine_is_kept_across_a_coordinator_restart() -> None:
    d = gpu_driver(nodes=1, per_node=2)
    d.submit("j", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    beat(d, "n0", GpuHealth(0, lost=True), GpuHealth(1))
    nodes = d.cluster.dump_nodes()
    jobs = [d.cluster.dump_job("j")]
    d2 = Driver()
    d2.cluster.restore(jobs, [], nodes, d.now + 1, reconnect_grace=15.0)
    (node,) = d2.cluster.nodes()
    assert node.state == "quarantined" and "GPU 0 (GPU-n0-0) is lost" in node.quarantine_reason
    assert node.quarantined_until == d.now + 3600.0
    assert [g.uuid for g in node.gpus] == ["GPU-n0-0", "GPU-n0-1"]


def test_gelastic_nodes_and_status_show_gpus_and_the_quarantine() -> None:
    from client._tables import nodes_table, status_text

    d = gpu_driver(nodes=1, per_node=2)
    d.submit("j", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    beat(d, "n0", GpuHealth(0, 81.0, 2**30, 66), GpuHealth(1, lost=True))
    text = nodes_table(d.cluster.nodes(), now=d.now)
    assert "quarantined" in text
    assert "n0: GPU 1 (GPU-n0-1) is lost" in text
    assert "--clear-quarantine" in text
    gpu_lines = [line.split() for line in text.splitlines() if line.startswith("  n0 ")]
    assert gpu_lines[0][:4] == ["n0", "0", "A100", "busy"] and gpu_lines[0][4] == "81"
    assert gpu_lines[1][:4] == ["n0", "1", "A100", "lost"]
    status = status_text(d.cluster.job_status("j"))
    assert "gpus:" in status
    (row,) = [line.split() for line in status.splitlines() if "GPU-n0-0" in line]
    assert row == ["0", "n0", "0", "GPU-n0-0", "81", "1024/40960", "66"]


def test_a_restarted_coordinator_still_knows_which_gpus_a_running_round_holds() -> None:
    d = gpu_driver(nodes=1, per_node=2)
    d.submit("a", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert assigns(d, "a")["n0"].assignment.gpus == (0,)
    d2 = Driver()
    d2.cluster.restore(
        [d.cluster.dump_job("a")], [], d.cluster.dump_nodes(), d.now, reconnect_grace=15.0
    )
    n = d.nodes["n0"]
    d2.nodes["n0"] = n
    pids = tuple(sorted(n.running[("a", 1)].items()))
    running = [RunningGroupReport("a", 1, 0, pids)]
    d2._take(
        d2.cluster.node_connected("n0", n.addr, 2, n.incarnation, d2.now, running, gpus("n0", 2))
    )
    assert d2.cluster.job_status("a").round == 1  # adopted, not re-formed
    d2.submit("b", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d2.settle()
    assert assigns(d2, "b")["n0"].assignment.gpus == (1,)  # not GPU 0: round "a" holds it


# ------------------------------------------------------------------------------------------------
# Histories: the whole cluster machine on GPU nodes, with GPU faults and clears among its steps
# ------------------------------------------------------------------------------------------------


class _GpuDriver(Driver):
    """Every node has twice the slots the histories give it (more jobs share a node), and one
    GPU per slot."""

    def connect(  # type: ignore[override]
        self,
        name: str,
        addr: str | None = None,
        slots: int = 1,
        incarnation: str | None = None,
        running: Sequence[RunningGroupReport] = (),
        gpus: Sequence[GpuDevice] = (),
    ) -> list[Effect]:
        slots *= 2
        return super().connect(
            name, addr, slots, incarnation, running, gpus or _node_gpus(name, slots)
        )


def _node_gpus(name: str, n: int) -> list[GpuDevice]:
    return [GpuDevice(i, f"GPU-{name}-{i}", "A100", 2**34) for i in range(n)]


class GpuClusterHistories(ClusterHistories):
    def __init__(self) -> None:
        super().__init__()
        self.d = _GpuDriver()
        self.ecc: dict[str, int] = {}
        for i, name in enumerate(_NAMES):  # all there from the start: more rounds share nodes
            self.d.connect(name, addr=f"10.0.0.{i + 1}", slots=1 + i % 2)

    @rule(name=st.sampled_from(_NAMES), lost=st.booleans())
    def gpu_fault(self, name: str, lost: bool) -> None:
        n = self.d.nodes.get(name)
        if n is None or n.mute:
            return
        self.ecc[name] = self.ecc.get(name, 0) + (0 if lost else 1)
        samples = [GpuHealth(0, uncorrectable_ecc=self.ecc[name], lost=lost)]
        self.d._take(
            self.d.cluster.step(name, n.incarnation, Heartbeat(gpus=tuple(samples)), self.d.now)
        )

    @rule(name=st.sampled_from(_NAMES))
    def clear(self, name: str) -> None:
        self.d._take(self.d.cluster.clear_quarantine(name, self.d.now)[1])

    @invariant()
    def no_gpu_is_held_twice_and_rounds_hold_what_they_were_given(self) -> None:
        c = self.d.cluster
        for n in c._nodes.values():
            held = [i for indices in n.gpu_jobs.values() for i in indices]
            assert len(held) == len(set(held)), (n.name, n.gpu_jobs)
            assert set(held) <= {g.index for g in n.gpus}, (n.name, n.gpu_jobs)
            assert set(n.gpu_jobs) <= set(n.jobs), (n.name, n.gpu_jobs, n.jobs)
            for job_id, indices in n.gpu_jobs.items():
                m = c._jobs[job_id].member(n.name)
                assert m is not None and list(m.gpus) == indices, (n.name, job_id)
                assert len(indices) == c._jobs[job_id].spec.nproc_per_node

    @invariant()
    def a_quarantined_node_gets_no_new_round(self) -> None:
        c = self.d.cluster
        for e in self.d.history[self._seen :]:
            if isinstance(e, AssignRound):
                node = c._nodes.get(e.node)
                assert node is None or not node.quarantine_reason, (
                    e.node,
                    node.quarantine_reason if node else "",
                )
        self._seen = len(self.d.history)

    _seen = 0


GpuClusterHistories.TestCase.settings = settings(
    max_examples=int(os.environ.get("GELASTIC_HISTORIES", "60")),
    stateful_step_count=40,
    deadline=None,
)
test_gpu_cluster_histories = GpuClusterHistories.TestCase


def test_a_finished_job_keeps_its_ranks_gpus_but_not_a_later_jobs_samples() -> None:
    d = gpu_driver(nodes=1, per_node=1)
    d.submit("a", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    d.finish("n0", "a")
    d.settle()
    assert d.state("a") == JobState.SUCCEEDED
    beat(d, "n0", GpuHealth(0, 99.0, 2**30, 80))  # another job's load, say
    (w,) = d.cluster.job_status("a").workers
    assert w.gpu is not None
    assert (w.gpu.index, w.gpu.uuid, w.gpu.utilization_percent, w.gpu.temperature_c) == (
        0,
        "GPU-n0-0",
        0.0,
        0,
    )


def test_a_failed_health_check_quarantines_the_node_and_moves_its_job() -> None:
    d = gpu_driver(nodes=2, per_node=2)
    d.submit("a", nproc_per_node=2, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    (ran_on,) = assigns(d, "a")
    n = d.nodes[ran_on]
    d._take(d.cluster.step(ran_on, n.incarnation, Heartbeat(health_problem="disk full"), d.now))
    d.settle()
    states = {x.name: (x.state, x.quarantine_reason) for x in d.cluster.nodes()}
    assert states[ran_on] == ("quarantined", "its health check failed: disk full")
    other = next(name for name in states if name != ran_on)
    assert states[other][0] == "live"
    assert any(a.node == other for a in of_type(d.history, AssignRound))
