"""FileTimer protocol parsing and expiry rules of the watchdog (fake kill, fake clock)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nodeagent._watchdog import (
    FileTimerServer,
    TimerFileError,
    TimerRequest,
    parse_request,
    validate_timer_file,
)


def line(**kw: object) -> bytes:
    data: dict[str, object] = {
        "version": 1,
        "pid": 42,
        "scope_id": "s",
        "expiration_time": 10.0,
        "signal": 9,
    }
    data.update(kw)
    return json.dumps(data).encode()


def test_parse_torch_request() -> None:
    assert parse_request(line()) == TimerRequest(42, "s", 10.0, 9)
    assert parse_request(line(expiration_time=-1, signal=0)).is_release


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"nope", "not JSON"),
        (b"[1]", "not a JSON object"),
        (
            json.dumps({"pid": 1, "scope_id": "s", "signal": 9}).encode(),
            "missing key 'expiration_time'",
        ),
        (line(pid="42"), "bad pid"),
        (line(pid=True), "bad pid"),
        (line(pid=-3), "bad pid"),
        (line(scope_id=3), "bad scope_id"),
        (line(expiration_time="soon"), "bad expiration_time"),
        (line(signal=9.5), "bad signal"),
    ],
)
def test_malformed_requests(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_request(raw)


class Recorder:
    def __init__(self) -> None:
        self.kills: list[tuple[int, int]] = []
        self.expired: list[tuple[int, str, int, float]] = []

    def kill(self, pid: int, sig: int) -> None:
        self.kills.append((pid, sig))

    def on_expired(self, pid: int, scope: str, sig: int, exp: float) -> None:
        self.expired.append((pid, scope, sig, exp))


def server(rec: Recorder, allowed: set[int]) -> FileTimerServer:
    return FileTimerServer(
        "/nonexistent/fifo",
        allowed_pids=allowed,
        on_expired=rec.on_expired,
        clock=lambda: 0.0,
        kill=rec.kill,
    )


def test_expiry_kills_with_the_earliest_signalled_timer() -> None:
    rec = Recorder()
    srv = server(rec, {42, 43})
    srv.register(TimerRequest(42, "late", 8.0, 15))
    srv.register(TimerRequest(42, "quiet", 5.0, 0))
    srv.register(TimerRequest(42, "early", 6.0, 9))
    srv.register(TimerRequest(43, "future", 50.0, 9))
    assert srv.expire(4.0) == []
    fired = srv.expire(9.0)
    assert [t.scope_id for t in fired] == ["early"]
    assert rec.kills == [(42, 9)]
    assert rec.expired == [(42, "early", 9, 6.0)]
    assert set(srv.timers) == {(43, "future")}


def test_release_and_rearm() -> None:
    rec = Recorder()
    srv = server(rec, {42})
    srv.register(TimerRequest(42, "s", 5.0, 9))
    srv.register(TimerRequest(42, "s", -1.0, 0))
    assert srv.expire(100.0) == [] and rec.kills == []
    srv.register(TimerRequest(42, "s", 5.0, 9))
    srv.register(TimerRequest(42, "s", 50.0, 9))  # re-acquire moves the deadline
    assert srv.expire(10.0) == []


def test_no_signal_never_kills_and_is_dropped() -> None:
    rec = Recorder()
    srv = server(rec, {42})
    srv.register(TimerRequest(42, "s", 5.0, 0))
    srv.register(TimerRequest(42, "t", 5.0, -9))
    assert srv.expire(10.0) == []
    assert rec.kills == [] and srv.timers == {}


def test_only_this_groups_workers_and_never_the_agent() -> None:
    rec = Recorder()
    srv = server(rec, {42, os.getpid()})
    srv.register(TimerRequest(1, "s", 5.0, 9))  # not a worker: ignored at once
    assert srv.timers == {}
    srv.register(TimerRequest(os.getpid(), "s", 5.0, 9))
    assert srv.expire(10.0) == []
    assert rec.kills == []


def test_allowed_pids_may_be_a_callable_and_forget_pid() -> None:
    rec = Recorder()
    alive = {42}
    srv = FileTimerServer(
        "/x",
        allowed_pids=lambda p: p in alive,
        on_expired=rec.on_expired,
        clock=lambda: 0.0,
        kill=rec.kill,
    )
    srv.register(TimerRequest(42, "s", 5.0, 9))
    srv.forget_pid(42)
    assert srv.timers == {}
    srv.register(TimerRequest(42, "s", 5.0, 9))
    alive.clear()  # the worker exited before the timer fired
    assert srv.expire(10.0) == [] and rec.kills == []


def test_a_pid_that_exited_before_the_kill_is_not_reported_as_killed() -> None:
    rec = Recorder()

    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError

    srv = FileTimerServer("/x", allowed_pids={42}, on_expired=rec.on_expired, kill=gone)
    srv.register(TimerRequest(42, "s", 5.0, 9))
    assert srv.expire(10.0) == [] and rec.expired == []
    assert srv.timers == {}


def test_timer_file_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "t.fifo"
    other = os.geteuid() + 1
    with pytest.raises(TimerFileError, match=f"not by the agent's uid {other}"):
        validate_timer_file(str(fifo), uid=other)
    os.mkfifo(fifo, 0o600)
    assert validate_timer_file(str(fifo)) == fifo  # a FIFO of ours, left by an earlier run
    with pytest.raises(TimerFileError, match="contains a NUL"):
        validate_timer_file(str(tmp_path / "a\0b"))
    with pytest.raises(TimerFileError, match="does not name a file"):
        validate_timer_file(str(tmp_path) + "/..")
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(TimerFileError, match="is a symlink"):
        validate_timer_file(str(link))
