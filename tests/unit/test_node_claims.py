"""Who gets a node's name: the decision (`judge_claim`) and what `Cluster.node_connected` makes
of it, on a fake clock.

Before the fix a new agent process under a live node's name was refused whatever it could prove:
for good while a session held the name, and until the reconnect grace ended while a restored
record kept it, with a message that called the dead holder live. Now a new process that proves
the node's secret takes the name over at once; any other is refused for good while a live agent
holds it, and for now (saying until when, and that the name is kept for its previous agent)
while only a restored record does.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from client.model import JobState
from coordinator._cluster import Cluster, NodeNameInUse, RequestPort
from coordinator._cluster_records import _Node
from coordinator._codec import encode
from coordinator._node_claims import Claim, judge_claim, secret_digest
from tests.unit._cluster_driver import Driver

SECRET = "0123456789abcdef" * 4
DIGEST = secret_digest(SECRET)
OTHER = secret_digest("fedcba9876543210" * 4)
GRACE = 15.0
LEASE = 5.0
NOW = 1_000_000.0


def _node(*, live: bool = True, attached: bool = True, digest: str = DIGEST) -> _Node:
    return _Node("n0", "10.0.0.1", 1, "inc-old", live, NOW, attached=attached, secret_digest=digest)


def _judge(
    node: _Node | None, incarnation: str, digest: str, *, session_open: bool = False
) -> Claim:
    return judge_claim(
        node, "n0", incarnation, digest, session_open=session_open, lease=LEASE, now=NOW + 1
    )


def test_secret_digest_is_a_hash_never_the_secret() -> None:
    assert secret_digest("") == ""
    assert re.fullmatch(r"[0-9a-f]{64}", DIGEST)
    assert SECRET not in DIGEST and secret_digest(SECRET) == DIGEST and DIGEST != OTHER


@pytest.mark.parametrize(
    ("node", "incarnation", "digest", "session_open", "claim"),
    [
        (None, "inc-new", DIGEST, False, Claim.JOIN),
        (None, "inc-new", "", False, Claim.JOIN),
        (_node(live=False, attached=False), "inc-new", OTHER, False, Claim.JOIN),
        (_node(attached=False), "inc-old", DIGEST, False, Claim.RESUME),
        (_node(attached=False, digest=""), "inc-old", DIGEST, False, Claim.RESUME),
        # A new process of the same node: restored (the grace) or with a session still open.
        (_node(attached=False), "inc-new", DIGEST, False, Claim.TAKE_OVER),
        (_node(), "inc-new", DIGEST, True, Claim.TAKE_OVER),
        (_node(), "inc-old", DIGEST, True, Claim.RESUME),
    ],
)
def test_what_a_hello_gets(
    node: _Node | None, incarnation: str, digest: str, session_open: bool, claim: Claim
) -> None:
    assert _judge(node, incarnation, digest, session_open=session_open) == claim


@pytest.mark.parametrize("digest", ["", OTHER])
@pytest.mark.parametrize("session_open", [False, True])
def test_an_unproven_agent_is_refused_for_good_under_a_live_agents_name(
    digest: str, session_open: bool
) -> None:
    with pytest.raises(NodeNameInUse) as err:
        _judge(_node(), "inc-new", digest, session_open=session_open)
    assert err.value.grace_left is None
    assert "live" in str(err.value)


@pytest.mark.parametrize(
    ("digest", "on_record", "why"),
    [
        ("", DIGEST, "sent no node secret"),
        (OTHER, DIGEST, "node secret is another"),
        (DIGEST, "", "no node secret is on record"),
        # The same incarnation without the secret on record does not pass for its agent.
        ("", DIGEST, "sent no node secret"),
    ],
)
def test_an_unproven_agent_under_a_restored_name_is_refused_for_now(
    digest: str, on_record: str, why: str
) -> None:
    node = _node(attached=False, digest=on_record)
    node.last_seen = NOW + GRACE - LEASE  # what restore gives it: the grace
    with pytest.raises(NodeNameInUse) as err:
        _judge(node, "inc-new", digest)
    message = str(err.value)
    assert err.value.grace_left == pytest.approx(GRACE - 1)
    assert re.search(r"kept for its previous agent until \d\d:\d\d:\d\d", message), message
    assert "reconnect grace" in message and why in message
    assert "live" not in message  # the holder may well be dead


def test_the_same_incarnation_without_the_recorded_secret_is_not_its_agent() -> None:
    with pytest.raises(NodeNameInUse) as err:
        _judge(_node(attached=False), "inc-old", "")
    assert err.value.grace_left is not None


# ---- in the cluster ------------------------------------------------------------------------------


def _restored(d: Driver, now: float) -> Cluster:
    """A new cluster from what `d.cluster` wrote (through JSON, as the store keeps it)."""
    jobs = [json.loads(json.dumps(d.cluster.dump_job(j))) for j in d.cluster.job_ids()]
    nodes = [json.loads(json.dumps(n)) for n in d.cluster.dump_nodes()]
    events = [encode(e) for j in d.cluster.job_ids() for e in d.cluster.job_events(j)]
    c = Cluster(d.cluster.config)
    c.restore(jobs, events, nodes, now, reconnect_grace=GRACE)
    return c


def _running(d: Driver) -> None:
    d.connect("n0", incarnation="inc-old", secret_digest=DIGEST)
    d.submit("j", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.RUNNING


def test_a_restarted_agent_takes_its_restored_node_back_at_once() -> None:
    d = Driver()
    _running(d)
    d.cluster = _restored(d, d.now + 1)
    d.advance(1)
    assert [n.state for n in d.cluster.nodes()] == ["reconnecting"]
    d.connect("n0", incarnation="inc-new", secret_digest=DIGEST)
    assert d.cluster.node_is_live("n0", "inc-new")
    assert [n.state for n in d.cluster.nodes()] == ["live"]
    # What ran there went with the old process: the job re-forms on the node, no restart spent.
    d.settle()
    assert (d.state("j"), d.cluster.job_status("j").attempt) == (JobState.RUNNING, 0)
    assert d.assignment("n0").round == 2
    kinds = [e.kind for e in d.cluster.job_events("j")]
    assert "node_lost" in kinds


def test_a_restarted_agent_takes_over_its_nodes_live_session() -> None:
    d = Driver()
    _running(d)
    d.connect("n0", incarnation="inc-new", secret_digest=DIGEST)
    assert d.cluster.node_is_live("n0", "inc-new")
    assert not d.cluster.node_is_live("n0", "inc-old")
    d.settle()
    assert (d.state("j"), d.assignment("n0").round) == (JobState.RUNNING, 2)


def test_another_agent_is_refused_and_changes_nothing() -> None:
    d = Driver()
    _running(d)
    with pytest.raises(NodeNameInUse):
        d.connect("n0", incarnation="inc-new", secret_digest=OTHER)
    d.cluster = _restored(d, d.now + 1)
    with pytest.raises(NodeNameInUse) as err:
        d.connect("n0", incarnation="inc-new", secret_digest=OTHER)
    assert err.value.grace_left is not None
    assert [n.state for n in d.cluster.nodes()] == ["reconnecting"]
    assert d.cluster.dump_node("n0")["secret_digest"] == DIGEST  # type: ignore[index]
    # Once the grace is over the node is lost, and the name goes to whoever asks.
    d.nodes["n0"].mute = True  # its agent is gone
    d.advance(GRACE + 2)
    assert [n.state for n in d.cluster.nodes()] == ["lost"]
    d.connect("n0", incarnation="inc-new", secret_digest=OTHER)
    assert d.cluster.dump_node("n0")["secret_digest"] == OTHER  # type: ignore[index]


def test_a_record_without_a_secret_takes_the_first_one_it_sees() -> None:
    """A node written before secrets existed: its own agent process resumes it as before, and
    the secret it shows is recorded (trust on first use); a later process proves that one."""
    d = Driver()
    d.connect("n0", incarnation="inc-old")
    nodes: list[dict[str, Any]] = [json.loads(json.dumps(n)) for n in d.cluster.dump_nodes()]
    for n in nodes:
        del n["secret_digest"]  # as an older coordinator wrote it
    c = Cluster(d.cluster.config)
    c.restore([], [], nodes, d.now + 1, reconnect_grace=GRACE)
    assert not c.bad_records
    d.cluster = c
    d.connect("n0", incarnation="inc-old", secret_digest=DIGEST)
    assert c.dump_node("n0")["secret_digest"] == DIGEST  # type: ignore[index]
    d.cluster = _restored(d, d.now + 1)
    d.connect("n0", incarnation="inc-new", secret_digest=DIGEST)
    assert d.cluster.node_is_live("n0", "inc-new")


def test_the_node_view_never_shows_the_digest() -> None:
    d = Driver()
    d.connect("n0", secret_digest=DIGEST)
    assert DIGEST not in repr(d.cluster.nodes())


def test_a_round_waiting_for_its_port_asks_again_when_its_node_is_back() -> None:
    """Round formed, port asked, coordinator restarted before the answer: the node comes back
    without the round, and the port is asked again at once, not when the grace ends."""
    d = Driver()
    d.connect("n0", incarnation="inc-old", secret_digest=DIGEST)
    d.nodes["n0"].port = -1  # the request is never answered
    d.submit("j", nproc_per_node=1, min_nodes=1, max_nodes=1, last_call_timeout=0.0)
    d.settle()
    assert d.state("j") == JobState.RENDEZVOUS
    d.cluster = _restored(d, d.now + 1)
    d.advance(1)
    d.nodes["n0"].port = None
    effects = d.connect("n0", incarnation="inc-old", secret_digest=DIGEST)
    assert any(isinstance(e, RequestPort) and e.job_id == "j" for e in effects), effects
    d.settle()
    assert d.state("j") == JobState.RUNNING
