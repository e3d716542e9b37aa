"""Worker health: psutil samples of each worker, and the judge that calls a worker unhealthy.

`HealthJudge` is pure (the clock is passed in): a worker whose process stays in uninterruptible
sleep (D) or stopped (T) for longer than the job's `unhealthy_timeout` is UNHEALTHY, like
torchelastic's TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT. `HealthSampler` reads the processes
with psutil in a worker thread, because /proc walks block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

__all__ = ["BAD_STATUSES", "HealthJudge", "HealthSample", "HealthSampler", "Unhealthy"]

STATUS_LETTERS = {
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_TRACING_STOP: "t",
}

BAD_STATUSES = frozenset({psutil.STATUS_DISK_SLEEP, psutil.STATUS_STOPPED})
"""Process states that count toward unhealthy_timeout."""


@dataclass(frozen=True)
class HealthSample:
    """One reading of one worker process."""

    pid: int
    timestamp: float
    status: str
    """psutil status ("running", "sleeping", "disk-sleep", "stopped", ...); "gone" if exited."""
    cpu_percent: float = 0.0
    rss_bytes: int = 0

    @property
    def alive(self) -> bool:
        return self.status not in ("gone", psutil.STATUS_ZOMBIE)


@dataclass(frozen=True)
class Unhealthy:
    """The judge's verdict on one worker."""

    pid: int
    status: str
    since: float
    duration: float

    @property
    def reason(self) -> str:
        letter = STATUS_LETTERS.get(self.status, "?")
        return f"process in state {self.status} ({letter}) for {self.duration:.1f} s"


class HealthJudge:
    """Decides from samples whether a worker has been stuck for too long (pure)."""

    def __init__(self, unhealthy_timeout: float) -> None:
        self.unhealthy_timeout = unhealthy_timeout
        self._bad_since: dict[int, float] = {}

    def observe(self, sample: HealthSample, now: float) -> Unhealthy | None:
        """Record a sample; returns a verdict once the bad state has lasted past the timeout."""
        if sample.status not in BAD_STATUSES:
            self._bad_since.pop(sample.pid, None)
            return None
        since = self._bad_since.setdefault(sample.pid, sample.timestamp)
        duration = now - since
        if duration > self.unhealthy_timeout:
            return Unhealthy(sample.pid, sample.status, since, duration)
        return None

    def bad_since(self, pid: int) -> float | None:
        return self._bad_since.get(pid)

    def forget(self, pid: int) -> None:
        self._bad_since.pop(pid, None)


class HealthSampler:
    """Reads cpu, rss and status of worker processes with psutil."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def _sample_one(self, pid: int, now: float) -> HealthSample:
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = psutil.Process(pid)
                # The first cpu_percent call only primes the counter.
                proc.cpu_percent(None)
                self._procs[pid] = proc
            with proc.oneshot():
                return HealthSample(
                    pid=pid,
                    timestamp=now,
                    status=proc.status(),
                    cpu_percent=proc.cpu_percent(None),
                    rss_bytes=proc.memory_info().rss,
                )
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            self._procs.pop(pid, None)
            return HealthSample(pid=pid, timestamp=now, status="gone")

    def sample_blocking(self, pids: Iterable[int], now: float) -> dict[int, HealthSample]:
        wanted = set(pids)
        for gone in set(self._procs) - wanted:
            del self._procs[gone]
        return {pid: self._sample_one(pid, now) for pid in wanted}

    async def sample(self, pids: Iterable[int], now: float) -> dict[int, HealthSample]:
        """Sample `pids` in a thread (psutil reads /proc, which can block)."""
        return await asyncio.to_thread(self.sample_blocking, list(pids), now)
