"""torch's elastic metrics, from a job's workers to their agent: one FIFO, one JSON line each.

A job with `torch_metrics` gets `GELASTIC_TORCH_METRICS` (the FIFO's path) in its workers' env.
The bootstrap then calls `install()` (this file is loaded by path, so it uses the standard
library only, as the bootstrap does): the moment the worker imports
`torch.distributed.elastic.metrics` (never before; a worker without torch imports nothing),
its default handler becomes one that writes each `put_metric` / `prof` / `publish_metric` as
one line ``{"j": job, "r": rank, "g": group, "n": name, "v": value}`` to the FIFO, without
blocking: a full FIFO, or more than RATE lines a second (bursts of BURST), drops the line.

The agent's end (`MetricChannel`) reads the FIFO when it is readable, at most READ_BYTES per
wake, keeps the latest value of each (job, group, name) of a job it accepts (at most
MAX_SERIES per job; the rest are counted in `dropped`), and hands the changed ones to each
heartbeat (`take`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

ENV = "GELASTIC_TORCH_METRICS"
MAX_LINE = 512
NAME = re.compile(r"[A-Za-z0-9_.:/@-]{1,128}")
"""A metric's group and name (fullmatch); anything else is dropped."""
MAX_VALUE = 1e18
RATE = 100.0
BURST = 500.0
MAX_SERIES = 100
READ_BYTES = 256 * 1024
_MODULE = "torch.distributed.elastic.metrics"

if TYPE_CHECKING:  # a worker's python may be 3.7: no tuple[...] at run time
    Metric = tuple[str, str, str, float]
    """(job id, group, name, value)."""


def encode(job_id: str, rank: int, group: str, name: str, value: object) -> bytes | None:
    """One line of the channel (None: not a metric the channel carries)."""
    v = _number(value)
    if v is None or not NAME.fullmatch(group) or not NAME.fullmatch(name):
        return None
    line = json.dumps({"j": job_id, "r": rank, "g": group, "n": name, "v": v}) + "\n"
    data = line.encode()
    return data if len(data) <= MAX_LINE else None


def decode(line: bytes) -> Metric | None:
    """(job, group, name, value) of one line, or None for one that is not well formed."""
    if len(line) > MAX_LINE:
        return None
    try:
        d = json.loads(line)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    job, group, name, v = d.get("j"), d.get("g"), d.get("n"), _number(d.get("v"))
    if v is None or not all(isinstance(x, str) and NAME.fullmatch(x) for x in (job, group, name)):
        return None
    return job, group, name, v  # type: ignore[return-value]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) and abs(v) <= MAX_VALUE else None


# ---- the worker's end --------------------------------------------------------------------------


class _FifoHandler:
    """A torch MetricHandler (duck-typed: torch calls `emit(metric_data)`) that never blocks."""

    def __init__(self, path: str, job_id: str, rank: int) -> None:
        self.path, self.job_id, self.rank = path, job_id, rank
        self._fd = -1
        self._tokens, self._at = BURST, time.monotonic()
        self.dropped = 0

    def emit(self, metric_data: Any) -> None:
        now = time.monotonic()
        self._tokens = min(BURST, self._tokens + (now - self._at) * RATE)
        self._at = now
        line = encode(
            self.job_id, self.rank, metric_data.group_name, metric_data.name, metric_data.value
        )
        if line is None or self._tokens < 1:
            self.dropped += 1
            return
        self._tokens -= 1
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.write(self._fd, line)  # at most MAX_LINE < PIPE_BUF: whole, or not at all
        except OSError:
            self.dropped += 1  # no agent reading, or the FIFO is full


class _Finder:
    """Configures torch's metrics right after the worker imports them (a meta path hook)."""

    def __init__(self, handler: _FifoHandler) -> None:
        self.handler = handler

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname != _MODULE:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        handler = self.handler

        def exec_module(module: Any) -> None:
            run(module)
            module.configure(handler)  # the default handler: every group

        loader.exec_module = exec_module
        return spec


def install(env: dict[str, str] | None = None) -> _FifoHandler | None:
    """In a worker of a job with torch_metrics: send torch's metrics to the agent."""
    env = dict(os.environ) if env is None else env
    path = env.get(ENV, "")
    if not path:
        return None
    rank = int(env.get("RANK", "-1")) if env.get("RANK", "").isdigit() else -1
    handler = _FifoHandler(path, env.get("GELASTIC_JOB_ID", ""), rank)
    module = sys.modules.get(_MODULE)
    if module is not None:  # a preload imported it already
        module.configure(handler)
    else:
        sys.meta_path.insert(0, _Finder(handler))
    return handler


# ---- the agent's end ---------------------------------------------------------------------------


class MetricChannel:
    """The FIFO at `path` (made 0600) and the latest value of each series of accepted jobs."""

    def __init__(self, path: str, accept: Callable[[str], bool]) -> None:
        self.path = path
        self._accept = accept
        """Whether a job's metrics are taken (a job this agent runs, with torch_metrics)."""
        self._fd = -1
        self._partial = b""
        self._latest: dict[str, dict[tuple[str, str], float]] = {}
        self._changed: dict[tuple[str, str, str], float] = {}
        self.dropped = 0

    def open(self) -> int:
        """Make the FIFO (a stale one of ours is replaced) and open it; the fd to watch."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(errno.EEXIST, f"{self.path} exists and is not our FIFO")
            os.unlink(self.path)
        os.mkfifo(self.path, 0o600)
        # Read and write: no EOF when the last worker closes it.
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        return self._fd

    def read(self) -> None:
        """Take what the FIFO holds now (at most READ_BYTES: the rest waits for the next wake)."""
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:
            self._partial, self.dropped = b"", self.dropped + 1
        for line in lines:
            self._take_line(line)

    def _take_line(self, line: bytes) -> None:
        m = decode(line)
        if m is None or not self._accept(m[0]):
            self.dropped += 1
            return
        job, group, name, value = m
        series = self._latest.setdefault(job, {})
        if (group, name) not in series and len(series) >= MAX_SERIES:
            self.dropped += 1
            return
        series[(group, name)] = value
        self._changed[(job, group, name)] = value

    @property
    def fd(self) -> int:
        return self._fd

    def take(self, limit: int) -> list[Metric]:
        """The series changed since the last take, at most `limit` (the rest wait). Then the
        series of jobs no longer accepted (done here) are let go of."""
        out = [(*key, self._changed.pop(key)) for key in list(self._changed)[:limit]]
        for job in [j for j in self._latest if not self._accept(j)]:
            del self._latest[job]
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.path)
