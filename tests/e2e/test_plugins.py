"""Plug-ins through the real programs' flags: `nodeagent --plugin` with a `before_round` veto
fails the job with the plug-in's reason, and `coordinator serve --event-log` writes the job's
events to a 0600 JSON-lines file, in order."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from client import JobSpec, JobState
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY

TIMEOUT = 60
REPO = str(Path(__file__).resolve().parents[2])


def test_a_vetoing_agent_plugin_and_the_event_log_through_the_flags(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    c = LocalCluster(
        nodes=0,
        workdir=tmp_path / "cluster",
        coordinator_args=["--event-log", str(log)],
        agent_args=["--plugin", "tests.service._site_plugins:Veto", "--plugin-timeout", "5"],
        env={"PYTHONPATH": REPO},
    )
    with c:
        c.start_agent("vetoing")
        job = c.client.submit(
            JobSpec(entrypoint=[PY, "-c", "pass"], min_nodes=1, max_nodes=1, last_call_timeout=0)
        )
        result = job.wait(timeout=TIMEOUT)
        assert result.is_failed()
        (failure,) = result.failures.values()
        assert (
            "before_round plug-in tests.service._site_plugins:Veto: scratch disk full on vetoing"
            in (failure.message)
        )
        assert failure.category.value == "INFRA"
        shown = [e.kind for e in job.events()]
        poll_until(
            lambda: (
                len([ln for ln in log.read_text().splitlines() if job.job_id in ln]) >= len(shown)
            ),
            TIMEOUT,
            what="the event log",
        )
        assert job.status().state == JobState.FAILED
    assert not c.killed, f"processes left behind: {c.killed}"
    written = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["kind"] for e in written if e["job_id"] == job.job_id] == shown
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
