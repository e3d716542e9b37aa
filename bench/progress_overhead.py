"""progress_overhead: what `client.progress()` costs a worker that steps 10,000 times a second.

One process, no cluster: a loop of steps of a fixed amount of work (about 100 us, so 10 kHz),
timed three ways, alternating, each `STEPS` steps:

- `step loop, no progress (us/step)`: the bare loop.
- `step loop, progress() outside gelastic (us/step)`: calling it with no
  `GELASTIC_PROGRESS_FILE` (a no-op after checking its arguments).
- `step loop, progress(step, loss=...) under gelastic (us/step)`: with the variable set to a
  file in a private temporary directory, so the real writer thread runs (5 writes a second).
- `progress(step, loss=...) call under gelastic (us)`: the call alone, in a loop of nothing
  else: what it adds to each step, less noisy than the difference of two loops on a busy host.

The notes give the slowdown of the loop against the bare one, and the call's cost as a share of
a 100 us (10 kHz) step, in percent. torchrun has no
equivalent: gelastic only.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time

from bench._common import GELASTIC, Measurement, log

SCENARIO = "progress_overhead"
STEPS, QUICK_STEPS = 100_000, 10_000
WORK = 800
"""Iterations of the step's work (about 100 us a step on a 2020s CPU)."""


def _loop(steps: int, report: bool) -> float:
    from client import progress

    sink = 0
    t0 = time.perf_counter()
    for step in range(steps):
        for i in range(WORK):
            sink += i
        if report:
            progress(step, loss=1.0)
    return (time.perf_counter() - t0) / steps * 1e6


def _call_cost(steps: int) -> float:
    from client import progress

    t0 = time.perf_counter()
    for step in range(steps):
        progress(step, loss=1.0)
    return (time.perf_counter() - t0) / steps * 1e6


def run(runs: int, quick: bool) -> list[Measurement]:
    module = importlib.import_module("client.progress")
    steps = QUICK_STEPS if quick else STEPS
    bare = Measurement(SCENARIO, "step loop, no progress (us/step)", GELASTIC)
    noop = Measurement(SCENARIO, "step loop, progress() outside gelastic (us/step)", GELASTIC)
    real = Measurement(
        SCENARIO, "step loop, progress(step, loss=...) under gelastic (us/step)", GELASTIC
    )
    call = Measurement(SCENARIO, "progress(step, loss=...) call under gelastic (us)", GELASTIC)
    with tempfile.TemporaryDirectory(prefix="bench-progress-") as d:
        path = os.path.join(d, "progress.json")
        for i in range(runs):
            os.environ.pop("GELASTIC_PROGRESS_FILE", None)
            bare.add(_loop(steps, report=False))
            noop.add(_loop(steps, report=True))
            os.environ["GELASTIC_PROGRESS_FILE"] = path
            real.add(_loop(steps, report=True))
            call.add(_call_cost(steps * 10))
            log(
                f"  {SCENARIO} run {i + 1}/{runs}: {bare.values[-1]:.1f} / "
                f"{noop.values[-1]:.1f} / {real.values[-1]:.1f} us per step"
            )
        os.environ.pop("GELASTIC_PROGRESS_FILE", None)
        written = os.path.exists(path)
        module.__dict__["_reporter"] = None  # its thread, a daemon, ends with the process
    slowdown = 100.0 * ((real.median or 0.0) / (bare.median or 1.0) - 1.0)
    real.note = (
        f"{slowdown:+.1f}% against the bare loop at {1e6 / (bare.median or 1.0):,.0f} steps/s; "
        f"the progress file was {'written' if written else 'NOT written'}"
    )
    call.note = f"{(call.median or 0.0):.2f}% of a 100 us (10 kHz) step"
    if not written:
        raise AssertionError(f"{SCENARIO}: the progress file was never written")
    return [bare, noop, real, call]
