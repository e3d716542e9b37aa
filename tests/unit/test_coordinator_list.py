"""Coordinator lists (`a:29400,b:29400`): parsing, the leader a standby names, and the order in
which a client or agent tries the listed replicas."""

from __future__ import annotations

import pytest

from client.coordinators import (
    HUNT_PASSES_MAX,
    HUNT_PAUSE_S,
    LEADER_HEADER,
    MAX_COORDINATORS,
    is_standby_answer,
    leader_hint,
    next_coordinator,
    parse_coordinators,
    reconnect_pause,
)
from nodeagent.session import AgentConfig


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:29400", ("127.0.0.1:29400",)),
        ("a:1,b:2,c:3", ("a:1", "b:2", "c:3")),
        (" a:1 , B.Example.COM:2 ", ("a:1", "b.example.com:2")),
        ("[::1]:29400,[2001:DB8:0:0::1]:5", ("[::1]:29400", "[2001:db8::1]:5")),
        ("host-1.internal.:65535", ("host-1.internal.:65535",)),
        # One gRPC target with a scheme is taken whole (its own commas included).
        ("ipv4:127.0.0.1:1,127.0.0.2:1", ("ipv4:127.0.0.1:1,127.0.0.2:1",)),
        ("unix:/run/gelastic.sock", ("unix:/run/gelastic.sock",)),
        (",".join(f"h{i}:1" for i in range(MAX_COORDINATORS)), tuple(f"h{i}:1" for i in range(16))),
    ],
)
def test_a_list_parses_to_its_addresses_in_order(text: str, parsed: tuple[str, ...]) -> None:
    assert parse_coordinators(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no address given"),
        ("a:1,,b:2", "entry 2 of 3 is empty"),
        ("a:1,b:2,", "entry 3 of 3 is empty"),
        ("a:1,b", "entry 2 of 2, 'b', is not HOST:PORT"),
        ("a:1,b:0", "entry 2 of 2, 'b:0': the port must be 1-65535"),
        ("a:99999", "the address, 'a:99999': the port must be 1-65535"),
        ("a:1,evil host:2", "entry 2 of 2, 'evil host:2', is not HOST:PORT"),
        ("a:1,x\n:2", "is not HOST:PORT"),
        ("a:1,-bad:2", "entry 2 of 2, '-bad:2', is not HOST:PORT"),
        ("a:1,b:2,a:1", "a:1 is in the list twice (entries 1 and 3)"),
        ("a:1,A:1", "a:1 is in the list twice"),
        ("[::g]:1", "is not HOST:PORT"),
        ("[1::2::3]:1", "not an IPv6 address"),
        ("http://a:1", "is not HOST:PORT"),
        (",".join(f"h{i}:1" for i in range(MAX_COORDINATORS + 1)), "more than 16 addresses"),
        ("a:1," + "x" * 10_000 + ":1", "at most 16 HOST:PORT addresses"),
        (".".join(["a" * 60] * 5) + ":1", "over 253 characters"),
        ("unix:/a b", "not a usable gRPC target"),
    ],
)
def test_a_bad_list_is_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^coordinator: ") as err:
        parse_coordinators(text)
    assert message in str(err.value)


def test_the_agent_config_refuses_a_bad_list() -> None:
    with pytest.raises(ValueError, match="entry 2 of 2, 'b', is not HOST:PORT"):
        AgentConfig(coordinator="a:1,b").validate()
    AgentConfig(coordinator="a:1,b:2").validate()


def test_the_agent_cli_names_the_bad_entry(capsys: pytest.CaptureFixture[str]) -> None:
    from nodeagent import cli as nodeagent_cli

    assert nodeagent_cli.main(["--coordinator", "a:1,b:2,b:2", "--name", "n1"]) == 2
    assert capsys.readouterr().err == (
        "nodeagent: coordinator: b:2 is in the list twice (entries 2 and 3)\n"
    )


LISTED = ("a:1", "b:2", "c:3")


@pytest.mark.parametrize(
    ("metadata", "hint"),
    [
        (((LEADER_HEADER, "b:2"),), "b:2"),
        (((LEADER_HEADER, "B:2"),), "b:2"),
        ((("other", "x"), (LEADER_HEADER, "c:3")), "c:3"),
        (((LEADER_HEADER, "evil:2"),), ""),  # not listed: never followed
        (((LEADER_HEADER, "b:2,c:3"),), ""),
        (((LEADER_HEADER, "b:2\n"),), "b:2"),
        (((LEADER_HEADER, "b:2 x"),), ""),
        (((LEADER_HEADER, b"b:2"),), ""),
        (((LEADER_HEADER, "x" * 5000),), ""),
        ((), ""),
        (None, ""),
    ],
)
def test_only_a_listed_leader_is_taken_from_a_standbys_answer(
    metadata: tuple[tuple[str, object], ...] | None, hint: str
) -> None:
    assert leader_hint(metadata, LISTED) == hint


def test_a_standby_answer_is_told_by_its_hint_or_its_words() -> None:
    assert is_standby_answer("not the leader; the leader is at b:2", False)
    assert is_standby_answer("no leader elected yet", False)
    assert is_standby_answer("anything", True)
    assert not is_standby_answer("the coordinator could not write its state", False)


def test_the_next_address_is_the_named_leader_else_the_next_untried_one() -> None:
    assert next_coordinator(LISTED, "a:1", {"a:1"}, "c:3") == "c:3"
    assert next_coordinator(LISTED, "a:1", {"a:1"}, "") == "b:2"
    assert next_coordinator(LISTED, "c:3", {"c:3"}, "") == "a:1"  # it wraps around
    # A hint to a replica already tried in this pass (a stale leader) is not followed again.
    assert next_coordinator(LISTED, "b:2", {"a:1", "b:2"}, "a:1") == "c:3"
    assert next_coordinator(LISTED, "c:3", {"a:1", "b:2", "c:3"}, "a:1") is None
    assert next_coordinator(LISTED, "a:1", {"a:1"}, "evil:9") == "b:2"
    assert next_coordinator(("a:1",), "a:1", {"a:1"}) is None


def test_reconnect_pause_is_short_while_hunting_over_a_list_and_doubles_otherwise() -> None:
    # Hunting over a list: the short pause, whatever the doubling delay has grown to.
    assert reconnect_pause(5.0, 1, 3) == HUNT_PAUSE_S
    assert reconnect_pause(0.05, HUNT_PASSES_MAX * 3, 3) == HUNT_PAUSE_S
    # Bounded: after that many passes over the list, the doubling backoff again.
    assert reconnect_pause(5.0, HUNT_PASSES_MAX * 3 + 1, 3) == (0.0, 5.0)
    # A single coordinator, or a failure that is not a leaderless answer: full jitter.
    assert reconnect_pause(5.0, 1, 1) == (0.0, 5.0)
    assert reconnect_pause(0.4, 0, 3) == (0.0, 0.4)
    assert HUNT_PAUSE_S[0] > 0 and HUNT_PAUSE_S[1] <= 0.5
