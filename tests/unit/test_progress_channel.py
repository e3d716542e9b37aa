"""The worker -> agent progress channel: `client.progress` (rate limiting on an injected clock,
bounds, a no-op outside gelastic), the agent's reading of the files (`nodeagent._progress_files`)
and the wire form of a report (`client.node_codec`)."""

from __future__ import annotations

import importlib
import itertools
import os
import stat
import threading
from pathlib import Path

import pytest

from client.node_codec import MessageError, decode_node, encode_node
from client.node_protocol import ProgressReport, RankProgress
from client.progress import ProgressBatcher, ProgressSample, parse_progress, progress
from nodeagent._progress_files import ProgressFiles
from protos.gelastic.v1 import gelastic_pb2 as pb

# The module (`client.progress` the attribute is the function the package exports).
progress_module = importlib.import_module("client.progress")


def test_the_batcher_writes_at_most_every_interval_only_what_changed_and_the_last_value() -> None:
    b = ProgressBatcher(every=0.2, rate_window=1.0)
    written = []
    t = 0.0
    for step in range(10_000):  # 10 kHz for one second
        t = step / 10_000
        b.offer(step, (), t)
        sample = b.due(t)
        if sample is not None:
            written.append((t, sample.step))
    assert 5 <= len(written) <= 6  # every 0.2 s, not every call
    assert all(b2 - a2 >= 0.2 - 1e-9 for (a2, _), (b2, _) in itertools.pairwise(written))
    # The last step reaches the file once the interval passed, even with no call after it.
    last = b.due(t + 0.2)
    assert last is not None and last.step == 9_999
    assert b.due(t + 5.0) is None  # unchanged: nothing to write


def test_the_rate_is_steps_per_second_over_at_least_the_window() -> None:
    b = ProgressBatcher(every=0.1, rate_window=1.0)
    rate = 0.0
    for i in range(40):  # 20 steps/s for 2 s
        b.offer(i, (), i * 0.05)
        sample = b.due(i * 0.05)
        if sample is not None:
            rate = sample.steps_per_s
    assert rate == pytest.approx(20.0, rel=0.05)


def test_metric_names_and_steps_are_bounded() -> None:
    with pytest.raises(ValueError, match="metric name"):
        progress(1, **{"bad-name": 1.0})
    with pytest.raises(ValueError, match="at most 16"):
        progress(1, **{f"m{i}": 1.0 for i in range(17)})
    with pytest.raises(ValueError, match="step"):
        progress(-1)
    with pytest.raises(ValueError, match="not a number"):
        progress(1, loss="high")  # type: ignore[arg-type]


def test_progress_is_a_no_op_outside_gelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GELASTIC_PROGRESS_FILE", raising=False)
    monkeypatch.setattr(progress_module, "_reporter", None)
    before = threading.active_count()
    progress(3, loss=1.0)
    assert progress_module._reporter is None and threading.active_count() == before


def test_a_worker_writes_its_file_0600_and_the_agent_reads_only_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "progress.json"
    monkeypatch.setenv("GELASTIC_PROGRESS_FILE", str(path))
    monkeypatch.setattr(progress_module, "_reporter", None)
    progress(5, loss=0.25)
    reporter = progress_module._reporter
    assert reporter is not None
    reporter.flush()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    files = ProgressFiles("j", 3, [(1, 9, path)])
    report = files.poll()
    assert report == ProgressReport("j", 3, (RankProgress(1, 9, 5, 0.0, (("loss", 0.25),)),))
    assert files.poll() is None  # nothing changed
    files.resend()
    assert files.poll() is not None  # a new session gets it again


def test_the_agent_ignores_a_file_that_is_not_a_progress_sample(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    files = ProgressFiles("j", 1, [(0, 0, path)])
    for bad in (
        b"not json",
        b'{"step": -4}',
        b'{"step": 1, "metrics": {"a b": 1}}',
        b'{"step": 1, "steps_per_s": "NaN"}',
        b'{"step": 1, "metrics": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"step": 1, "metrics": {"x": 1}}' + b" " * 5000,
    ):
        path.write_bytes(bad)
        assert files.poll() is None, bad[:40]
    assert parse_progress(b'{"step": 2, "steps_per_s": 1.5}') == ProgressSample(2, 1.5)


def test_a_progress_report_crosses_the_wire_and_a_forged_one_is_refused() -> None:
    msg = ProgressReport("j", 2, (RankProgress(0, 4, 10, 3.5, (("loss", 0.1),)),))
    assert decode_node(encode_node(msg)) == msg
    bad = pb.NodeMessage(
        progress_report=pb.ProgressReport(
            job_id="j", round=2, ranks=[pb.RankProgress(step=1, metrics={"no way": 1.0})]
        )
    )
    with pytest.raises(MessageError):
        decode_node(bad)
