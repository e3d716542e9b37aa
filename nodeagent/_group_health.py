"""A worker group's health: the latest sample of each worker, and which ones are stuck.

`HealthWatch` samples the group's live workers (psutil, in a thread) and keeps each one's
latest sample for the heartbeat (`WorkerHealth`); its judge says when one has been in D or T
state past the job's `unhealthy_timeout`, and `run` is the monitor loop that condemns it.
Killing it is the supervisor's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from nodeagent import _faults
from nodeagent._health import HealthJudge, HealthSample, HealthSampler
from nodeagent._launch import WorkerLaunch

__all__ = ["HealthWatch", "WorkerHealth"]


@dataclass(frozen=True)
class WorkerHealth:
    """The latest health sample of one worker."""

    local_rank: int
    global_rank: int
    pid: int
    status: str
    """psutil status: "running", "sleeping", "disk-sleep", "stopped", ..."""
    cpu_percent: float
    rss_bytes: int
    timestamp: float
    bad_since: float | None = None
    """Since when the worker has been in D or T state (None = it is not)."""


class HealthWatch:
    """Samples and judges the workers of one group."""

    def __init__(self, unhealthy_timeout: float, interval: float | None = None) -> None:
        self.unhealthy_timeout = unhealthy_timeout
        self.interval = (
            interval if interval is not None else min(5.0, max(0.2, unhealthy_timeout / 4))
        )
        """Seconds between two samples."""
        self._judge = HealthJudge(unhealthy_timeout)
        self._sampler = HealthSampler()
        self._samples: dict[int, HealthSample] = {}
        """local rank -> its latest sample."""

    async def sample(self, live: Mapping[int, WorkerLaunch]) -> dict[int, HealthSample]:
        """Sample the live workers ({pid: launch}); each one's sample is kept as its latest."""
        samples = await self._sampler.sample(live, time.time())
        for pid, sample in samples.items():
            self._samples[live[pid].local_rank] = sample
        return samples

    async def run(
        self,
        live: Callable[[], Mapping[int, WorkerLaunch] | None],
        judged: Callable[[int], bool],
        condemn: Callable[[int, str], None],
    ) -> None:
        """The health monitor: every `interval` s, sample the workers `live()` says run ({pid:
        launch}; none: it ends; None: the group stops), judge each one still `judged(pid)`
        after the sampling, and `condemn(pid, why)` the one stuck for too long."""
        while (workers := live()) is not None:
            _faults.monitor()
            if not workers:
                return
            samples = await self.sample(workers)
            now = time.time()
            for pid, sample in samples.items():
                if not judged(pid):
                    continue
                why = self.judge(sample, now)
                if why is not None:
                    condemn(pid, why)
            await asyncio.sleep(self.interval)

    def judge(self, sample: HealthSample, now: float) -> str | None:
        """Why the worker sampled is unhealthy, once it has been stuck too long (else None)."""
        verdict = self._judge.observe(sample, now)
        if verdict is None:
            return None
        return (
            f"worker is unhealthy: {verdict.reason}, longer than "
            f"unhealthy_timeout={self.unhealthy_timeout:g} s"
        )

    def forget(self, pid: int) -> None:
        """The worker `pid` is gone."""
        self._judge.forget(pid)

    def latest(self, running: Iterable[WorkerLaunch]) -> list[WorkerHealth]:
        """The latest sample of each of the `running` workers that has one, in their order."""
        out = []
        for launch in running:
            s = self._samples.get(launch.local_rank)
            if s is None:
                continue
            out.append(
                WorkerHealth(
                    local_rank=launch.local_rank,
                    global_rank=launch.global_rank,
                    pid=s.pid,
                    status=s.status,
                    cpu_percent=s.cpu_percent,
                    rss_bytes=s.rss_bytes,
                    timestamp=s.timestamp,
                    bad_since=self._judge.bad_since(s.pid),
                )
            )
        return out
