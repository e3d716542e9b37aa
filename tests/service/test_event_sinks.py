"""Coordinator event sinks: a plug-in named module:object receives every event of a real job in
order, a JSON-lines file gets them too (0600, rotated by size), neither sees the job's secrets,
and a sink that hangs loses events, counted, without holding the coordinator up."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest

from client.model import JobEvent, JobSpec, JobState
from coordinator._cluster import EventRecorded
from coordinator._event_sinks import EventSinks, JsonLinesFile, load_event_sink
from coordinator.server import Coordinator, CoordinatorConfig
from nodeagent.session import AgentConfig, NodeAgent
from tests._helpers import wait_for
from tests.service import _site_plugins

WAIT_S = 60.0

FAIL_FIRST = """
import os, sys
sys.exit(3 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


def _event(seq: int, reason: str = "r") -> JobEvent:
    return JobEvent(seq=seq, job_id="j", timestamp=float(seq), kind="submitted", reason=reason)


async def test_a_sink_receives_a_real_jobs_events_in_order(tmp_path: Path) -> None:
    _site_plugins.RECEIVED.clear()
    log = tmp_path / "events.jsonl"
    config = CoordinatorConfig(
        state_dir=str(tmp_path / "state"),
        port=0,
        heartbeat_interval=0.2,
        event_sinks=("tests.service._site_plugins:record",),
        event_log=str(log),
    )
    async with Coordinator(config) as c:
        agent = NodeAgent(
            AgentConfig(
                coordinator=c.address, name="n1", addr="127.0.0.1", log_dir=str(tmp_path / "logs")
            )
        )
        async with agent:
            spec = JobSpec(
                entrypoint=[sys.executable, "-c", FAIL_FIRST],
                args=["--password=hunter2"],
                env={"API_TOKEN": "s3cret-value"},
                min_nodes=1,
                max_nodes=1,
                last_call_timeout=0,
                max_restarts=1,
            )
            job = await c.service.submit(spec)
            await wait_for(
                lambda: c.service.cluster.job_state(job) == JobState.SUCCEEDED,
                WAIT_S,
                what="the job to succeed",
            )
            want = len(c.service.cluster.job_events(job))
            await wait_for(
                lambda: len(_site_plugins.RECEIVED) >= want, WAIT_S, what="the sink's events"
            )
    kinds = [e.kind for e in _site_plugins.RECEIVED if e.job_id == job]
    assert {"submitted", "round_formed", "worker_failed", "finished"} <= set(kinds), kinds
    firsts = [kinds.index(k) for k in ("submitted", "round_formed", "worker_failed", "finished")]
    assert firsts == sorted(firsts), kinds
    assert kinds[-1] == "finished" and kinds.count("round_formed") == 2, kinds
    seqs = [e.seq for e in _site_plugins.RECEIVED]
    assert seqs == sorted(seqs)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [d["kind"] for d in lines if d["job_id"] == job] == kinds
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    everything = log.read_text() + repr(_site_plugins.RECEIVED)
    assert "hunter2" not in everything and "s3cret-value" not in everything


def test_the_jsonl_file_is_0600_and_rotates_at_its_size(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text("")
    path.chmod(0o644)  # an existing file is made private
    sink = JsonLinesFile(str(path), max_bytes=4096, backups=2)
    try:
        for i in range(200):
            sink.emit(_event(i, "x" * 100))
        sink.emit(_event(999, "y" * 500_000))  # one huge reason: cut to a line that fits
    finally:
        sink.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["ev.jsonl", "ev.jsonl.1", "ev.jsonl.2"]
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert f.stat().st_size <= 70_000
        for line in f.read_text().splitlines():
            json.loads(line)
    assert json.loads(path.read_text().splitlines()[-1])["seq"] == 999


def test_the_jsonl_file_refuses_a_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "ev.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        JsonLinesFile(str(tmp_path / "ev.jsonl"))


def test_a_hanging_sink_drops_counted_and_never_blocks() -> None:
    _site_plugins.Blocked.release.clear()
    name, sink = load_event_sink("tests.service._site_plugins:Blocked")
    sinks = EventSinks([(name, sink)], queue_events=2)
    sinks.start()
    try:
        began = time.monotonic()
        for i in range(50):
            sinks.observe([EventRecorded(_event(i))])
        assert time.monotonic() - began < 1.0  # generous: no put waits on the sink
        assert 47 <= sinks.dropped()[name] <= 48  # one taken by the sink, two queued
    finally:
        _site_plugins.Blocked.release.set()
        sinks.stop()
    assert [e.seq for e in sink.events] == sorted(e.seq for e in sink.events)
    assert 2 <= len(sink.events) <= 3


@pytest.mark.parametrize(
    "ref", ["nomodule", "os:", "a b:c", "tests.service._site_plugins:missing", "jsonl:"]
)
def test_a_bad_sink_name_is_refused_naming_it(ref: str) -> None:
    with pytest.raises(ValueError, match=r"plug-in|event sink"):
        load_event_sink(ref)


def test_a_sink_that_is_neither_callable_nor_emits_is_refused() -> None:
    with pytest.raises(ValueError, match="neither callable"):
        load_event_sink("tests.service._site_plugins:RECEIVED")
