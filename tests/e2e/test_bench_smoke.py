"""The benchmark suite runs: `python -m bench --quick` exits 0 with a number for every scenario.

Keeps `bench/` from rotting; the numbers themselves are not checked (speed targets live in the
benchmarks, not in tests). Nothing the benchmark started may outlive it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from bench.__main__ import SCENARIOS
from bench._common import TORCHRUN
from client._local import poll_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180
MARK = "GELASTIC_BENCH_SMOKE"
SCALE_METRICS = [
    ("rendezvous_scale", "N=10 submit -> all assigned"),
    ("rendezvous_scale", "N=10 submit -> all started"),
    ("rendezvous_scale", "N=10 coordinator peak RSS (MB)"),
    ("heartbeat_capacity", "N=100 coordinator CPU (cores)"),
    ("heartbeat_capacity", "N=100 simulated agents CPU (cores)"),
    ("footprint", "idle agent RSS (MB)"),
    ("footprint", "idle agent CPU (%)"),
    ("footprint", "agent RSS, 8 workers (MB)"),
    ("coordinator_restart", "2 agents: restart -> recovered"),
    ("coordinator_restart", "2 agents: restart -> all adopted"),
    ("coordinator_restart", "10 simulated agents: restart -> recovered"),
    ("submit_throughput", "1 client thread: jobs/s (50 jobs)"),
    ("submit_throughput", "8 client threads: jobs/s (50 jobs)"),
]


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun (gelastic[torch]) not installed")
def test_quick_bench_reports_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    mark = uuid.uuid4().hex  # inherited by everything the benchmark starts
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "--quick", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, MARK: mark},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for p in _marked(mark):
            p.kill()
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"python -m bench --quick ran over {TIMEOUT} s:\n{output.decode()[-4000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    doc = json.loads(out.read_text())
    assert doc["meta"]["quick"] is True
    assert doc["meta"]["failed"] == []
    for scenario in SCENARIOS:
        medians = [
            m["median"]
            for m in doc["measurements"]
            if m["scenario"] == scenario and m["system"] == "gelastic"
        ]
        assert medians, f"{scenario}: no gelastic measurement in {out}"
        assert all(v is not None and v > 0 for v in medians), (scenario, medians)
    systems = {m["system"] for m in doc["measurements"]}
    assert systems == {"gelastic", "torchrun"}
    # The scale, restart and throughput scenarios at their smallest size, one sample each.
    metrics = {(m["scenario"], m["metric"]): m for m in doc["measurements"]}
    for key in SCALE_METRICS:
        assert key in metrics, f"{key} missing from {out}"
        assert metrics[key]["n"] >= 1 and metrics[key]["timeouts"] == 0, metrics[key]
    assert "scenario" in text and "median" in text  # the table was printed

    try:
        poll_until(lambda: not _marked(mark), 15, what="the benchmark's processes to exit")
    except TimeoutError:
        left = [(p.pid, p.name()) for p in _marked(mark)]
        for p in _marked(mark):
            p.kill()
        raise AssertionError(f"the benchmark left processes behind: {left}") from None
