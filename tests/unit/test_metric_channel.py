"""The torch metrics channel: lines bounded and validated both ways, a worker that never blocks
(no agent, a full FIFO, a burst), an agent that keeps a bounded set of series of the jobs it
accepts, and torch configured only when the worker imports torch's metrics itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from nodeagent import _metric_channel as mc


def _data(group: str, name: str, value: object) -> SimpleNamespace:
    return SimpleNamespace(group_name=group, name=name, value=value)


@pytest.mark.parametrize(
    ("group", "name", "value"),
    [
        ("g", "bad name", 1),
        ("g", "x" * 129, 1),
        ("", "n", 1),
        ("g", "n", float("nan")),
        ("g", "n", float("inf")),
        ("g", "n", 1e19),
        ("g", "n", True),
        ("g", "n", "3"),
    ],
)
def test_what_is_not_a_bounded_metric_is_never_written(
    group: str, name: str, value: object
) -> None:
    assert mc.encode("job-1", 0, group, name, value) is None


def test_a_line_round_trips_and_garbage_decodes_to_nothing() -> None:
    line = mc.encode("job-1", 3, "torchelastic", "my.metric", 3)
    assert line is not None and line.endswith(b"\n") and len(line) <= mc.MAX_LINE
    assert mc.decode(line) == ("job-1", "torchelastic", "my.metric", 3.0)
    for bad in (b"", b"[1]", b"{", b'{"j": "a b", "g": "g", "n": "n", "v": 1}', b"x" * 600):
        assert mc.decode(bad) is None


def _channel(tmp_path: Path, accepted: set[str]) -> mc.MetricChannel:
    ch = mc.MetricChannel(str(tmp_path / "m.fifo"), accepted.__contains__)
    ch.open()
    return ch


def _write(path: str, *lines: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        for line in lines:
            os.write(fd, line)
    finally:
        os.close(fd)


def test_the_agent_keeps_the_latest_of_accepted_jobs_within_the_cap(tmp_path: Path) -> None:
    ch = _channel(tmp_path, {"job-a"})
    try:
        assert (tmp_path / "m.fifo").stat().st_mode & 0o777 == 0o600
        lines = [mc.encode("job-a", 0, "g", f"s{i}", i) for i in range(mc.MAX_SERIES + 5)]
        lines += [mc.encode("job-a", 1, "g", "s0", 42), mc.encode("job-b", 0, "g", "s", 1)]
        _write(ch.path, *[x for x in lines if x is not None], b"not json\n", b'{"partial": ')
        ch.read()
        taken = ch.take(1000)
        assert len(taken) == mc.MAX_SERIES
        assert ("job-a", "g", "s0", 42.0) in taken  # the latest value of a series
        assert ch.dropped == 5 + 1 + 1  # over the cap, a job not accepted, the garbage
        assert ch.take(1000) == []  # nothing changed since
        _write(ch.path, b"1}\n", mc.encode("job-a", 0, "g", "s1", 9) or b"")
        ch.read()
        assert ch.take(1) == [("job-a", "g", "s1", 9.0)]
    finally:
        ch.close()
    assert not (tmp_path / "m.fifo").exists()


def test_the_agent_refuses_a_path_that_is_not_its_fifo(tmp_path: Path) -> None:
    (tmp_path / "m.fifo").write_text("mine")
    with pytest.raises(OSError, match="not our FIFO"):
        mc.MetricChannel(str(tmp_path / "m.fifo"), lambda _j: True).open()
    assert (tmp_path / "m.fifo").read_text() == "mine"


def test_a_worker_never_blocks_without_an_agent_or_past_its_rate(tmp_path: Path) -> None:
    lonely = mc._FifoHandler(str(tmp_path / "nobody"), "job-a", 0)
    lonely.emit(_data("g", "n", 1))
    assert lonely.dropped == 1
    ch = _channel(tmp_path, {"job-a"})
    try:
        handler = mc._FifoHandler(ch.path, "job-a", 0)
        for i in range(int(mc.BURST) + 200):
            handler.emit(_data("g", f"n{i % 50}", i))
        written = os.read(ch.fd, 1 << 20).count(b"\n")
        assert written + handler.dropped == int(mc.BURST) + 200
        assert 150 <= handler.dropped <= 200  # the burst spent, the rest over the rate
    finally:
        ch.close()


def test_torch_is_configured_only_once_the_worker_imports_its_metrics(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    ch = _channel(tmp_path, {"job-a"})
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(mc.__file__).parent)!r})
        import _metric_channel
        _metric_channel.install({{"GELASTIC_TORCH_METRICS": {ch.path!r},
                                  "GELASTIC_JOB_ID": "job-a", "RANK": "2"}})
        assert "torch" not in sys.modules
        from torch.distributed.elastic.metrics import put_metric
        put_metric("my.metric", 3)
        print("ok")
        """
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
        ch.read()
        assert ch.take(10) == [("job-a", "torchelastic", "my.metric", 3.0)]
    finally:
        ch.close()


def test_a_job_without_the_channel_installs_nothing() -> None:
    before = list(sys.meta_path)
    assert mc.install({"RANK": "0"}) is None
    assert sys.meta_path == before


async def test_an_agent_that_cannot_make_its_channel_runs_without_it(tmp_path: Path) -> None:
    from nodeagent._agent_rounds import RoundControl

    rounds = RoundControl(
        "n",
        dirs=lambda: (tmp_path, tmp_path),
        registry=None,  # type: ignore[arg-type]
        standbys=None,  # type: ignore[arg-type]
        send=lambda _m: None,
        spawn=lambda _c, _n: None,
        started=lambda _h: None,
        closing=lambda: False,
    )
    (tmp_path / "m.fifo").write_text("not a FIFO")
    rounds.open_metrics(tmp_path / "m.fifo")
    assert rounds.metrics is None and rounds.take_metrics() == ()
    rounds.open_metrics(tmp_path / "ok.fifo")
    assert rounds.metrics is not None
    rounds.close_metrics()
    assert not (tmp_path / "ok.fifo").exists()
