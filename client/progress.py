"""The worker side of progress reporting: `progress(step, **metrics)` tells the agent a step ended.

A training loop calls it once a step (or more often: it is cheap)::

    from client import progress

    for step in range(start, steps):
        loss = train_one_step()
        progress(step, loss=loss)

What the coordinator makes of it: each rank's step, steps/s and metrics in `job.status()`,
`gelastic status`, `gelastic top` and the dashboard; a job whose ranks stop stepping is stalled
(`JobSpec.stall_timeout`), a rank much slower than the others a straggler.

The call only keeps the values: a thread of this module writes the latest of them, at most
every `FLUSH_EVERY_S`, to the file its agent names in `GELASTIC_PROGRESS_FILE` (a small JSON,
written 0600 beside the worker's logs and renamed into place), so 10,000 steps a second cost a
few microseconds each and the agent reads a few files a second. No gRPC, no torch. Outside
gelastic (no `GELASTIC_PROGRESS_FILE`) it does nothing.

Bounds: at most `MAX_METRICS` metrics, names `re.fullmatch`ing `METRIC_NAME`, finite floats;
anything else raises ValueError at the call, so a bad name is found at the first step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "FLUSH_EVERY_S",
    "MAX_METRICS",
    "MAX_PROGRESS_BYTES",
    "MAX_STEP",
    "METRIC_NAME",
    "PROGRESS_FILE_ENV",
    "ProgressBatcher",
    "ProgressSample",
    "parse_progress",
    "progress",
]

PROGRESS_FILE_ENV = "GELASTIC_PROGRESS_FILE"
FLUSH_EVERY_S = 0.2
"""The most often the file is written: a rank's progress reaches its agent this late at most."""
RATE_WINDOW_S = 1.0
"""Steps/s is measured over at least this many seconds."""
MAX_METRICS = 16
MAX_STEP = 2**62
MAX_PROGRESS_BYTES = 4096
"""A progress file is a few hundred bytes; a bigger one is not one."""
METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")


@dataclass(frozen=True)
class ProgressSample:
    """One rank's latest progress, as written to (and read from) its progress file."""

    step: int
    steps_per_s: float = 0.0
    metrics: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> bytes:
        doc = {"step": self.step, "steps_per_s": self.steps_per_s, "metrics": dict(self.metrics)}
        return json.dumps(doc, separators=(",", ":")).encode()


_known_names: set[str] = set()
"""Metric names already checked (a loop reports the same few every step)."""
MAX_KNOWN_NAMES = 1024


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)  # type: ignore[arg-type]  # a 0-d tensor or numpy scalar
        except (TypeError, ValueError):
            raise ValueError(f"metric {name}: not a number") from None
    f = float(value)
    if not math.isfinite(f):
        f = 0.0 if math.isnan(f) else math.copysign(1e308, f)
    return f


def _check_metrics(metrics: Mapping[str, object]) -> tuple[tuple[str, float], ...]:
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"at most {MAX_METRICS} metrics, got {len(metrics)}")
    out = []
    for name, value in metrics.items():
        if name not in _known_names:
            if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
                raise ValueError(f"metric name {str(name)[:80]!r}: must be [A-Za-z_][A-Za-z0-9_.]*")
            if len(_known_names) < MAX_KNOWN_NAMES:
                _known_names.add(name)
        # A finite float, the usual case, as it is; anything else through _number.
        ok = type(value) is float and value - value == 0.0
        out.append((name, value if ok else _number(name, value)))
    return tuple(out)  # type: ignore[arg-type]


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step: must be an int in 0..2**62, got {step!r:.80}")
    return step


def parse_progress(data: bytes) -> ProgressSample | None:
    """A progress file's content as a sample; None for anything that is not one (the agent reads
    files a worker wrote: never trusted)."""
    if len(data) > MAX_PROGRESS_BYTES:
        return None
    try:
        doc = json.loads(data)
        step = _check_step(doc["step"])
        rate = float(doc.get("steps_per_s", 0.0))
        metrics = doc.get("metrics", {})
        if not isinstance(metrics, dict) or any(
            isinstance(v, bool) or not isinstance(v, int | float) for v in metrics.values()
        ):
            return None
        checked = _check_metrics(metrics)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    if not math.isfinite(rate) or rate < 0:
        return None
    return ProgressSample(step, min(rate, 1e9), checked)


class ProgressBatcher:
    """What to write, and when (pure: the clock is passed in). `offer` keeps the latest values
    (one assignment: it runs on every step); `due` says what to write now, if anything: the
    latest sample, at most every `every` seconds, and only when it changed. Steps/s is measured
    between offers at least `rate_window` seconds apart."""

    def __init__(self, every: float = FLUSH_EVERY_S, rate_window: float = RATE_WINDOW_S) -> None:
        self.every = every
        self.rate_window = rate_window
        self._latest: tuple[int, tuple[tuple[str, float], ...], float] | None = None
        self._written: ProgressSample | None = None
        self._written_at = -math.inf
        self._rate = 0.0
        self._rate_mark: tuple[int, float] | None = None

    def offer(self, step: int, metrics: tuple[tuple[str, float], ...], now: float) -> None:
        self._latest = (step, metrics, now)

    def due(self, now: float) -> ProgressSample | None:
        latest = self._latest
        if latest is None or now - self._written_at < self.every:
            return None
        step, metrics, at = latest
        mark = self._rate_mark
        if mark is None or step < mark[0]:
            self._rate_mark = (step, at)
        elif at - mark[1] >= self.rate_window:
            self._rate = (step - mark[0]) / (at - mark[1])
            self._rate_mark = (step, at)
        sample = ProgressSample(step, round(self._rate, 3), tuple(sorted(metrics)))
        if sample == self._written:
            return None
        self._written, self._written_at = sample, now
        return sample


class _Reporter:
    """The process's reporter: the batcher, and the thread that writes what it says is due."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self.batcher = ProgressBatcher()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gelastic-progress", daemon=True)
        self.thread.start()

    def offer(self, step: int, metrics: tuple[tuple[str, float], ...]) -> None:
        self.batcher.offer(step, metrics, self.clock())  # one assignment: no lock

    def flush(self) -> None:
        with self.lock:
            sample = self.batcher.due(self.clock())
        if sample is not None:
            _write(self.path, sample.to_json())

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the process
            self.wake.wait(FLUSH_EVERY_S)
            # OSError: the agent's directory went away: the worker is being stopped.
            with contextlib.suppress(OSError):
                self.flush()


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_reporter: _Reporter | None = None
_reporter_lock = threading.Lock()


def progress(step: int, **metrics: float) -> None:
    """Report that step `step` ended, with a few metrics (`loss=0.5`); a no-op outside gelastic.

    Cheap enough for every step: it keeps the values, a thread writes the latest a few times a
    second. ValueError for a step that is not an int in 0..2**62, more than 16 metrics, a
    metric name that is not [A-Za-z_][A-Za-z0-9_.]* (64 at most) or a value that is not a number.
    """
    global _reporter
    checked_step = _check_step(step)
    checked = _check_metrics(metrics) if metrics else ()
    reporter = _reporter
    if reporter is None:
        path = os.environ.get(PROGRESS_FILE_ENV)
        if not path:
            return
        with _reporter_lock:
            if _reporter is None:
                _reporter = _Reporter(path)
            reporter = _reporter
    reporter.offer(checked_step, checked)
