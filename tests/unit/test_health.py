"""The health judge: D/T state for longer than unhealthy_timeout makes a worker unhealthy."""

from __future__ import annotations

import os

from nodeagent._health import HealthJudge, HealthSample, HealthSampler


def sample(status: str, t: float, pid: int = 10) -> HealthSample:
    return HealthSample(pid=pid, timestamp=t, status=status)


def test_disk_sleep_longer_than_timeout_is_unhealthy() -> None:
    judge = HealthJudge(unhealthy_timeout=60.0)
    assert judge.observe(sample("disk-sleep", 100.0), now=100.0) is None
    assert judge.observe(sample("disk-sleep", 130.0), now=130.0) is None
    assert judge.observe(sample("disk-sleep", 160.0), now=160.0) is None  # not *longer* yet
    verdict = judge.observe(sample("disk-sleep", 161.0), now=161.0)
    assert verdict is not None
    assert (verdict.pid, verdict.status, verdict.since, verdict.duration) == (
        10,
        "disk-sleep",
        100.0,
        61.0,
    )
    assert verdict.reason == "process in state disk-sleep (D) for 61.0 s"


def test_stopped_counts_and_d_t_mix_is_one_bad_stretch() -> None:
    judge = HealthJudge(unhealthy_timeout=5.0)
    assert judge.observe(sample("stopped", 0.0), now=0.0) is None
    assert judge.observe(sample("disk-sleep", 3.0), now=3.0) is None
    verdict = judge.observe(sample("stopped", 6.0), now=6.0)
    assert verdict is not None and verdict.reason == "process in state stopped (T) for 6.0 s"


def test_a_good_sample_resets_the_clock() -> None:
    judge = HealthJudge(unhealthy_timeout=5.0)
    judge.observe(sample("disk-sleep", 0.0), now=0.0)
    assert judge.bad_since(10) == 0.0
    assert judge.observe(sample("running", 4.0), now=4.0) is None
    assert judge.bad_since(10) is None
    assert judge.observe(sample("disk-sleep", 5.0), now=5.0) is None
    assert judge.observe(sample("disk-sleep", 9.0), now=9.0) is None
    assert judge.observe(sample("disk-sleep", 10.5), now=10.5) is not None


def test_sleeping_zombie_and_gone_are_not_unhealthy() -> None:
    judge = HealthJudge(unhealthy_timeout=1.0)
    for status in ("sleeping", "running", "zombie", "gone", "idle"):
        judge.observe(sample(status, 0.0), now=0.0)
        assert judge.observe(sample(status, 100.0), now=100.0) is None


def test_workers_are_judged_separately_and_forgotten() -> None:
    judge = HealthJudge(unhealthy_timeout=1.0)
    judge.observe(sample("disk-sleep", 0.0, pid=1), now=0.0)
    judge.observe(sample("disk-sleep", 1.5, pid=2), now=1.5)
    assert judge.observe(sample("disk-sleep", 2.0, pid=1), now=2.0) is not None
    assert judge.observe(sample("disk-sleep", 2.0, pid=2), now=2.0) is None
    judge.forget(1)
    assert judge.observe(sample("disk-sleep", 2.1, pid=1), now=2.1) is None


def test_sampler_reads_this_process_and_reports_gone_pids() -> None:
    sampler = HealthSampler()
    out = sampler.sample_blocking([os.getpid(), 2**22 + 12345], now=5.0)
    me = out[os.getpid()]
    assert me.alive and me.rss_bytes > 0 and me.timestamp == 5.0
    assert me.status in ("running", "sleeping")
    assert out[2**22 + 12345].status == "gone"
    assert not out[2**22 + 12345].alive
