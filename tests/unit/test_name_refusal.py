"""What an agent makes of a refusal of its name: temporary ones are retried, however long.

Before the fix every name-in-use refusal counted against the agent's patience, the coordinator's
time for a gone holder plus a margin, after which the agent gave up for good (exit 2) saying a
live agent held its name: a coordinator that restarted again inside the reconnect grace began
the hold again while the patience kept counting. Now a refusal the coordinator marks as
temporary (the name is kept for the node's previous agent during the grace) never counts.
"""

from __future__ import annotations

import grpc
import pytest

from client.security import Security
from nodeagent import _agent_link
from nodeagent._agent_link import NAME_GRACE_HEADER, NAME_HELD_HEADER, SessionLink


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _link() -> SessionLink:
    return SessionLink(
        "n1",
        "127.0.0.1",
        ("127.0.0.1:1",),
        Security.from_files(""),
        reconnect_max=0.5,
        hello=lambda: None,  # type: ignore[arg-type,return-value]
        replay=lambda: [],
        dispatch=lambda _m: None,
        heartbeat=lambda _o, _s: None,
        opened=lambda _o, _l: None,
        closed=lambda: None,
        closing=lambda: False,
    )


def _refusal(details: str, *metadata: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*metadata),
        details,
    )


def test_a_temporary_refusal_is_retried_however_long_it_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_agent_link.time, "monotonic", clock)
    link = _link()
    grace = _refusal(
        "node name 'n1' is kept for its previous agent until 12:00:15 (its reconnect grace ...)",
        (NAME_HELD_HEADER, "15000"),
        (NAME_GRACE_HEADER, "15000"),
    )
    # Three coordinator restarts in a row, each beginning a 15 s grace: 45 s of refusals.
    for _ in range(450):
        reason = link._name_refused(grace, "127.0.0.1:1", grace.details() or "")
        assert not link.refused.is_set(), link.refusal
        assert "keeps this node's name for its previous agent" in reason
        clock.t += 0.1


def test_a_live_holder_ends_the_agent_once_its_time_is_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_agent_link.time, "monotonic", clock)
    link = _link()
    live = _refusal(
        "node name 'n1' already has a live session; a new one is refused until that one ends",
        (NAME_HELD_HEADER, "2000"),
    )
    tries = 0
    while not link.refused.is_set():
        link._name_refused(live, "127.0.0.1:1", live.details() or "")
        clock.t += 0.1
        tries += 1
        assert tries < 1000
    # The lease (2 s) and the margin (3 s) of patience, no more.
    assert 5.0 <= tries * 0.1 <= 5.3
    assert link.refusal.startswith("node name 'n1' is in use by another live agent")
