"""A list of jobs shows each job's summary: the same size and cost whatever the job's width.

`Cluster.job_summary` leaves out the workers and all but the first members asked for; a
ListJobs entry and a row of the dashboard's jobs page are made from it, so neither grows with
a job's ranks or nodes (before, both carried every node, and ListJobs every worker too).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from client.model import JobState
from coordinator._dashboard_views import NODES_PER_JOB_ROW, ROW_TEXT_MAX, DashboardModel
from coordinator._job_list import LIST_TEXT_MAX, list_entry
from tests.unit._cluster_driver import Driver

NODES = 40
NPROC = 8


def _running(nodes: int = NODES) -> Driver:
    d = Driver()
    for i in range(nodes):
        d.connect(f"node-{i:02d}", addr=f"10.0.0.{i + 1}", slots=NPROC)
    d.submit("j", nproc_per_node=NPROC, min_nodes=nodes, max_nodes=nodes, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.RUNNING
    return d


def test_a_summary_is_the_status_without_workers_and_with_the_members_asked_for() -> None:
    d = _running()
    status = d.cluster.job_status("j")
    assert len(status.workers) == NODES * NPROC and len(status.members) == NODES
    summary = d.cluster.job_summary("j")
    assert summary.workers == () and summary.members == ()
    assert summary.nodes_joined == NODES and summary.world_size == NODES * NPROC
    assert summary == dataclasses.replace(status, workers=(), members=())
    assert d.cluster.job_summary("j", members_shown=3).members == status.members[:3]


class _Service:
    """What `DashboardModel` reads of the coordinator's service: its cluster and clock."""

    def __init__(self, d: Driver) -> None:
        self.cluster = d.cluster
        self._d = d

    def now(self) -> float:
        return self._d.now


def test_a_dashboard_job_row_names_a_few_nodes_and_counts_them_all() -> None:
    d = _running()
    model = DashboardModel(cast(Any, _Service(d)))
    row = model.job_row("j", d.now)
    members = d.cluster.job_status("j").members
    assert row["nodes"] == [m.node for m in members[:NODES_PER_JOB_ROW]]
    assert row["nodes_total"] == NODES and row["world_size"] == NODES * NPROC
    d.cancel("j")
    d.settle()
    assert model.overview()["jobs"][0]["nodes_total"] == NODES
    long_reason = "x" * (ROW_TEXT_MAX * 4)
    d.cluster._jobs["j"].reason = long_reason
    assert len(model.job_row("j", d.now)["reason"]) <= ROW_TEXT_MAX + len(" [...]")


def test_a_list_entry_holds_no_worker_and_no_member_and_cuts_its_reasons() -> None:
    d = _running()
    d.cancel("j")
    d.settle()
    entry = list_entry(d.cluster, "j")
    assert not entry.workers and not entry.members and not entry.HasField("spec")
    assert entry.world_size == NODES * NPROC and entry.nodes_joined == NODES
    assert entry.has_result and entry.result.root_cause_rank == -1
    d.cluster._jobs["j"].reason = "y" * (LIST_TEXT_MAX * 4)
    assert len(list_entry(d.cluster, "j").reason) <= LIST_TEXT_MAX + len(" [...]")
    assert list_entry(d.cluster, "j").ByteSize() < 4 * LIST_TEXT_MAX
