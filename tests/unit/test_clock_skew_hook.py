"""The agent's test-only clock skew (`GELASTIC_AGENT_FAULTS=clock-skew:S`): off by default, and
when armed every wall time the agent reports reads S seconds off, whoever took it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from client.model import ProcessFailure
from client.node_protocol import (
    ClockReply,
    Heartbeat,
    Hello,
    RunningGroup,
    WorkerExit,
    WorkerExited,
    WorkerFailing,
)
from nodeagent import _faults


@pytest.fixture
def disarmed() -> Iterator[None]:
    yield None
    _faults.configure("")


def _failure(ts: float) -> ProcessFailure:
    return ProcessFailure(0, 0, 7, 1, "ValueError: v", ts, node="n0", time_uncertainty=0.01)


@pytest.mark.parametrize(
    ("text", "skew"),
    [("clock-skew:+0.5", 0.5), ("clock-skew:-0.25", -0.25), (" clock-skew:3600 ", 3600.0)],
)
def test_a_clock_skew_parses(
    text: str, skew: float, disarmed: None, caplog: pytest.LogCaptureFixture
) -> None:
    _faults.configure(text)
    assert _faults.clock_skew() == skew
    assert _faults._armed is None  # no supervision fault with it
    assert not caplog.records


@pytest.mark.parametrize(
    "text",
    ["clock-skew:", "clock-skew:0.5s", "clock-skew:+-1", "clock-skew:3601", "clock-skew:nan"],
)
def test_a_bad_clock_skew_is_ignored_with_a_warning(
    text: str, disarmed: None, caplog: pytest.LogCaptureFixture
) -> None:
    _faults.configure(text)
    assert _faults.clock_skew() == 0.0
    assert any("GELASTIC_AGENT_FAULTS" in r.getMessage() for r in caplog.records)


def test_the_skew_is_off_by_default_and_then_changes_nothing(disarmed: None) -> None:
    code = "import nodeagent._faults as f; print(f.clock_skew())"
    env = {k: v for k, v in __import__("os").environ.items() if k != _faults.ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "0.0"
    armed = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, _faults.ENV: "clock-skew:-0.5"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert armed.stdout.strip() == "-0.5"
    msg = WorkerExited("j", 1, WorkerExit(0, 0, 7, 1, failure=_failure(100.0), timestamp=101.0))
    assert _faults.skewed(msg) is msg


def test_every_wall_time_the_agent_reports_is_skewed(disarmed: None) -> None:
    _faults.configure("clock-skew:+0.5")
    exit_ = WorkerExit(0, 0, 7, 1, failure=_failure(100.0), timestamp=101.0)
    exited = _faults.skewed(WorkerExited("j", 1, exit_))
    assert isinstance(exited, WorkerExited)
    assert exited.exit.timestamp == 101.5
    assert exited.exit.failure is not None and exited.exit.failure.precise_timestamp == 100.5
    # Only the time moves: how precise it is stays the agent's.
    assert exited.exit.failure.time_uncertainty == 0.01
    failing = _faults.skewed(WorkerFailing("j", 1, _failure(100.0)))
    assert isinstance(failing, WorkerFailing) and failing.failure.precise_timestamp == 100.5
    reply = _faults.skewed(ClockReply(50.0, 60.0, 61.0))
    assert reply == ClockReply(50.0, 60.5, 61.5)  # the coordinator's own time is not the host's
    hello = _faults.skewed(
        Hello("n0", "10.0.0.1", 1, "i", running=(RunningGroup("j", 1, 0, ((0, 7),), (exit_,)),))
    )
    assert isinstance(hello, Hello)
    (held,) = hello.running[0].exits
    assert held.timestamp == 101.5 and held.failure is not None
    assert held.failure.precise_timestamp == 100.5
    beat = Heartbeat(3)
    assert _faults.skewed(beat) is beat
