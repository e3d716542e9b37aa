"""Retention: finished jobs, their events and results, and gone nodes are deleted past the bounds."""

from __future__ import annotations

import json

import pytest

from client.model import JobState
from coordinator._cluster import Cluster, ClusterConfig, Forgotten, NodeIsLive
from coordinator._codec import encode

from ._cluster_driver import Driver, of_type, spec

ONE = {"nproc_per_node": 1, "min_nodes": 1, "max_nodes": 1, "last_call_timeout": 0.0}


def _config(**kw: float) -> ClusterConfig:
    return ClusterConfig(heartbeat_interval=1.0, lease=5.0, **kw)  # type: ignore[arg-type]


def _run_to_end(d: Driver, job_id: str) -> None:
    d.submit(job_id, **ONE)
    d.settle()
    d.finish("n0", job_id)
    d.settle()
    assert d.state(job_id) == JobState.SUCCEEDED


def test_the_oldest_finished_jobs_beyond_the_count_are_forgotten() -> None:
    d = Driver(_config(retain_jobs=2))
    d.connect("n0")
    for i in range(3):
        _run_to_end(d, f"j{i}")
    assert d.cluster.job_ids() == ["j1", "j2"]
    assert of_type(d.history, Forgotten) == [Forgotten(job_id="j0")]


def test_a_running_job_is_never_forgotten_however_many_finish() -> None:
    d = Driver(_config(retain_jobs=0))
    d.connect("n0")
    d.connect("n1")
    d.submit("long", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("long") == JobState.RUNNING
    d.submit("short", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    (node,) = [n for n, fake in d.nodes.items() if "short" in fake.assignments]
    d.finish(node, "short")
    d.settle()
    assert d.cluster.job_ids() == ["long"]


def test_finished_jobs_are_forgotten_after_the_retention_time() -> None:
    d = Driver(_config(retain_seconds=60.0))
    d.connect("n0")
    _run_to_end(d, "j")
    d.advance(59)
    assert d.cluster.has_job("j")
    d.advance(2)
    assert not d.cluster.has_job("j")
    assert of_type(d.history, Forgotten) == [Forgotten(job_id="j")]


def test_a_forgotten_jobs_request_id_is_free_again() -> None:
    d = Driver(_config(retain_jobs=0))
    d.connect("n0")
    d._take(d.cluster.submit("j", spec(**ONE), d.now, request_id="r1"))
    assert d.cluster.job_for_request("r1") == "j"
    d.settle()
    d.finish("n0", "j")
    d.settle()
    assert d.cluster.job_for_request("r1") is None


def test_a_gone_node_is_forgotten_after_the_retention_time() -> None:
    d = Driver(_config(retain_seconds=120.0))
    d.connect("n0")
    d.connect("n1")
    d.disconnect("n1")
    d.advance(60)
    assert {n.name for n in d.cluster.nodes()} == {"n0", "n1"}
    d.advance(130)
    assert {n.name for n in d.cluster.nodes()} == {"n0"}
    assert Forgotten(node="n1") in d.history


def test_restore_trims_to_the_same_bounds() -> None:
    d = Driver(_config())
    d.connect("n0")
    for i in range(4):
        _run_to_end(d, f"j{i}")
    jobs = [json.loads(json.dumps(d.cluster.dump_job(j))) for j in d.cluster.job_ids()]
    events = [encode(e) for j in d.cluster.job_ids() for e in d.cluster.job_events(j)]
    nodes = [json.loads(json.dumps(n)) for n in d.cluster.dump_nodes()]
    c = Cluster(_config(retain_jobs=1))
    out = c.restore(jobs, events, nodes, d.now, reconnect_grace=15.0)
    assert c.job_ids() == ["j3"]
    assert sorted(f.job_id for f in of_type(out, Forgotten)) == ["j0", "j1", "j2"]


def test_lost_nodes_are_dropped_after_the_lost_node_retention() -> None:
    d = Driver(_config(lost_node_retention=100.0))
    d.connect("n0")
    d.connect("n1")
    d.disconnect("n1")
    d.advance(70)
    assert {n.name for n in d.cluster.nodes()} == {"n0", "n1"}
    d.advance(100)
    assert {n.name for n in d.cluster.nodes()} == {"n0"}
    assert Forgotten(node="n1") in d.history


def test_lost_nodes_beyond_the_count_go_longest_unseen_first() -> None:
    d = Driver(_config(max_lost_nodes=2))
    d.connect("live")
    for i in range(4):
        d.connect(f"gone{i}")
    for i in range(4):
        d.advance(1)
        d.disconnect(f"gone{i}")
    d.advance(61)  # the node retention runs once a minute
    assert {n.name for n in d.cluster.nodes()} == {"live", "gone2", "gone3"}
    assert {f.node for f in of_type(d.history, Forgotten)} == {"gone0", "gone1"}


def test_a_restart_keeps_the_time_a_lost_node_was_last_seen() -> None:
    d = Driver(_config())
    d.connect("n0")
    d.connect("n1")
    d.advance(5)
    d.disconnect("n1")
    lost_at = next(n.last_seen for n in d.cluster.nodes() if n.name == "n1")
    d.advance(600)
    nodes = [json.loads(json.dumps(n)) for n in d.cluster.dump_nodes()]
    c = Cluster(_config())
    c.restore([], [], nodes, d.now, reconnect_grace=15.0)
    after = {n.name: n for n in c.nodes()}
    assert after["n1"].state == "lost"
    assert after["n1"].last_seen == lost_at
    assert after["n0"].last_seen >= d.now  # a live one gets the reconnect grace


def test_forget_node_drops_a_lost_node_refuses_a_live_one_and_ignores_unknown() -> None:
    d = Driver(_config())
    d.connect("n0")
    d.connect("n1")
    d.disconnect("n1")
    with pytest.raises(NodeIsLive):
        d.cluster.forget_node("n0", d.now)
    assert Forgotten(node="n1") in d.cluster.forget_node("n1", d.now)
    assert of_type(d.cluster.forget_node("n1", d.now), Forgotten) == []
    assert of_type(d.cluster.forget_node("nobody", d.now), Forgotten) == []
    assert {n.name for n in d.cluster.nodes()} == {"n0"}
