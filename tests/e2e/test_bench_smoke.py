"""The benchmark suite runs: `python -m bench --quick` exits 0 with a number for every scenario.

Keeps `bench/` from rotting; the numbers themselves are not checked (speed targets live in the
benchmarks, not in tests). Nothing the benchmark started may outlive it. The soak, which runs
only when named, has a test of its own: `python -m bench soak --quick` (about 30 s).
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

from bench.__main__ import DEFAULT_SCENARIOS
from bench._common import TORCHRUN
from gelastic.local import poll_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 200
MARK = "GELASTIC_BENCH_SMOKE"
SCALE_METRICS = [
    ("rendezvous_scale", "N=10 submit -> all assigned"),
    ("rendezvous_scale", "N=10 submit -> all started"),
    ("rendezvous_scale", "N=10 coordinator peak RSS (MB)"),
    ("heartbeat_capacity", "N=100 coordinator CPU (cores)"),
    ("heartbeat_capacity", "N=100 simulated agents CPU (cores)"),
    ("progress_load", "N=50 x8 coordinator CPU, heartbeats only (cores)"),
    ("progress_load", "N=50 x8 coordinator CPU, progress at 10 Hz (cores)"),
    ("progress_overhead", "progress(step, loss=...) call under gelastic (us)"),
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


def _run_bench(args: list[str], mark: str, timeout: float) -> tuple[int, str]:
    """`python -m bench ARGS` with `mark` in its environment; its exit code and output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        env={**os.environ, MARK: mark},  # inherited by everything the benchmark starts
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in _marked(mark):
            p.kill()
        output, _ = proc.communicate(timeout=30)
        pytest.fail(
            f"python -m bench {' '.join(args)} ran over {timeout:g} s:\n{output.decode()[-4000:]}"
        )
    return proc.returncode, output.decode(errors="replace")


def _why(text: str) -> str:
    """What a failed benchmark printed: each scenario's failure (said in the middle of the
    output, with the numbers after it), then the end of the output."""
    failures = [line for line in text.splitlines() if " FAILED: " in line]
    return "\n".join([*failures, "...", text[-3000:]])


def _assert_nothing_left(mark: str) -> None:
    try:
        poll_until(lambda: not _marked(mark), 15, what="the benchmark's processes to exit")
    except TimeoutError:
        left = [(p.pid, p.name()) for p in _marked(mark)]
        for p in _marked(mark):
            p.kill()
        raise AssertionError(f"the benchmark left processes behind: {left}") from None


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun (gelastic[torch]) not installed")
def test_quick_bench_reports_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    mark = uuid.uuid4().hex
    code, text = _run_bench(["--quick", "--json", str(out)], mark, TIMEOUT)
    assert code == 0, _why(text)

    doc = json.loads(out.read_text())
    assert doc["meta"]["quick"] is True
    assert doc["meta"]["failed"] == []
    assert doc["meta"]["scenarios"] == list(DEFAULT_SCENARIOS)
    for scenario in DEFAULT_SCENARIOS:
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
    _assert_nothing_left(mark)


SOAK_TIMEOUT = 120


@pytest.mark.timeout(SOAK_TIMEOUT + 60)
def test_quick_soak_writes_rows_and_passes_coordinator_args_on(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    mark = uuid.uuid4().hex
    # A flag `coordinator serve` has today: the soak must hand it over word for word.
    args = ["soak", "--quick", "--json", str(out), "--coordinator-arg=--log-level=INFO"]
    code, text = _run_bench(args, mark, SOAK_TIMEOUT)
    assert code == 0, _why(text)

    doc = json.loads(out.read_text())
    assert doc["meta"]["scenarios"] == ["soak"] and doc["meta"]["failed"] == []
    soak = doc["meta"]["soak"]
    assert soak["options"]["coordinator_args"] == ["--log-level=INFO"]
    assert soak["problems"] == [], soak
    rows = soak["rows"]
    assert len(rows) >= 3, rows  # the start, at least one interval, the end
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    assert all(r["rss_mb"] > 0 and r["state_mb"] > 0 for r in rows), rows
    assert any(r["submit_p99_ms"] is not None for r in rows), rows
    # Every short job ended the way its kind says, and none was left running.
    assert rows[-1]["unexpected"] == 0 and rows[-1]["stuck"] == 0, soak
    assert rows[-1]["finished"] > 0 and rows[-1]["in_flight"] == 0, soak
    assert soak["background_state"] == "RUNNING", soak
    assert soak["sim_live"] == soak["options"]["nodes"], soak
    metrics = {m["metric"]: m for m in doc["measurements"] if m["scenario"] == "soak"}
    assert len(metrics) == 3 and all(m["median"] > 0 for m in metrics.values()), metrics
    assert "one row per interval" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass  # drawing is optional, as in every scenario
    else:
        assert (tmp_path / "soak.png").stat().st_size > 0
    _assert_nothing_left(mark)


TORCH_TIMEOUT = 240


@pytest.mark.timeout(TORCH_TIMEOUT + 60)
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun (gelastic[torch]) not installed")
def test_quick_torch_failure_reports_the_raise_on_both_systems(tmp_path: Path) -> None:
    """The torch scenarios run only when named; one of them at its smallest size keeps the torch
    worker and its torchrun side working (a real gloo init + all_reduce per rank)."""
    out = tmp_path / "torch.json"
    mark = uuid.uuid4().hex
    code, text = _run_bench(["torch_failure", "--quick", "--json", str(out)], mark, TORCH_TIMEOUT)
    assert code == 0, _why(text)

    doc = json.loads(out.read_text())
    assert doc["meta"]["scenarios"] == ["torch_failure"] and doc["meta"]["failed"] == []
    metrics = {(m["metric"], m["system"]): m for m in doc["measurements"]}
    for system in ("gelastic", "torchrun"):
        m = metrics[("2x2 raise -> FAILED at the client (poll)", system)]
        assert m["n"] == 1 and m["timeouts"] == 0 and m["median"] > 0, m
    _assert_nothing_left(mark)
