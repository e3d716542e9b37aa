"""The root cause across hosts whose clocks disagree, with real agents.

Two agents; one's host clock reads half a second ahead (the agent's test-only clock skew,
`GELASTIC_AGENT_FAULTS=clock-skew:+0.5`: every time it reports, its workers' error-file times
included, is shifted). A rank on the skewed node fails first for real; the other node's rank
fails 0.15 s later with a gloo "Connection closed by peer". By the nodes' own clocks the
collateral failure is 0.35 s earlier; the coordinator, which measured the skewed clock over the
agent's session, still names the true first failure as the root cause.
"""

from __future__ import annotations

from collections.abc import Callable

from client import JobSpec
from client.model import NodeInfo, RunResult
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, Gate, script

SKEW_S = 0.5
LATE_S = 0.15


def _node(nodes: list[NodeInfo], name: str) -> NodeInfo:
    return next(n for n in nodes if n.name == name)


def test_the_root_cause_is_the_true_first_failure_on_a_host_whose_clock_is_ahead(
    make_cluster: Callable[..., LocalCluster], gate: Gate
) -> None:
    cluster = make_cluster(nodes=1)
    cluster.start_agent("node-1", env={"GELASTIC_AGENT_FAULTS": f"clock-skew:+{SKEW_S}"})
    client = cluster.client

    # The coordinator measured both clocks over the sessions (`gelastic nodes` shows them).
    def measured() -> bool:
        nodes = client.list_nodes()
        skewed, plain = _node(nodes, "node-1"), _node(nodes, "node-0")
        return (
            0 < skewed.clock_uncertainty < 0.05
            and abs(skewed.clock_offset - SKEW_S) <= skewed.clock_uncertainty
            and 0 < plain.clock_uncertainty < 0.05
            and abs(plain.clock_offset) <= plain.clock_uncertainty
        )

    poll_until(measured, 30, what="both clocks measured, node-1 half a second ahead")

    spec = JobSpec(
        entrypoint=[PY, script("skewed_failure.py")],
        nproc_per_node=1,
        min_nodes=2,
        max_nodes=2,
        max_restarts=0,
        stop_grace=10,
        env={**gate.env, "FIRST_NODE": "node-1", "LATE_S": str(LATE_S)},
    )
    job = client.submit(spec)
    gate.wait("ready", 2)
    gate.open("go")

    def both_failed() -> RunResult | None:
        r = job.poll()
        return r if r is not None and len(r.failures) == 2 else None

    poll_until(lambda: both_failed() is not None, 60, what="both ranks' failures in the result")
    result = both_failed()
    assert result is not None and result.is_failed()
    (first,) = gate.events("raise", node="node-1")
    (later,) = gate.events("raise", node="node-0")
    # What really happened, by the one clock of this host: node-1's rank went first.
    assert 0.1 <= later["time"] - first["time"] <= 1.0, (first, later)
    by_node = {f.node: f for f in result.failures.values()}
    true_first, collateral = by_node["node-1"], by_node["node-0"]
    # By each node's own clock the collateral failure was first: what the old order chose.
    assert (
        collateral.precise_timestamp + collateral.clock_offset
        < true_first.precise_timestamp + true_first.clock_offset
    )

    root = result.root_cause
    assert root is not None
    assert root.node == "node-1", result.format_failures()
    assert root.message.startswith("ValueError: the true first failure"), root.message
    assert true_first.root_cause and not collateral.root_cause
    # Its time on the coordinator's clock (this host's): where the worker saw it.
    assert abs(true_first.precise_timestamp - first["time"]) < 0.05
    assert abs(true_first.clock_offset - SKEW_S) < 0.05
    assert abs(collateral.precise_timestamp - later["time"]) < 0.05
    report = result.format_failures()
    assert "(corrected for the node's clock, +0.50" in report
    assert "root cause, perhaps because of it" in report
