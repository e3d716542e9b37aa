"""progress_load: the coordinator's CPU while every rank reports its progress at 10 Hz.

A fresh `coordinator serve` process (heartbeat 1 s, lease 10 s) and N simulated nodes
(`_simnodes.py`, 2 processes of their own) of 8 slots; one job of N nodes x 8 ranks runs on
them with `stall_timeout` set, so the coordinator also judges stalls and stragglers on its tick.
Every node heartbeats once a second with its 8 workers' health samples. Each rank steps at
10 Hz: as the real agent does, each node forwards what changed of its ranks' progress twice a
second (one ProgressReport of 8 ranks), however often they step.

After a warm-up, CPU seconds per wall second over windows, first with the progress reports off
(heartbeats only: the baseline), then on:

- `N=n x8 coordinator CPU, heartbeats only (cores)`
- `N=n x8 coordinator CPU, progress at 10 Hz (cores)`: the note gives the reports/s received
  and what one costs (the difference over the reports).
- `N=n x8 status with progress (s)`: one `job.status()` of the N x 8 ranks, with their progress.

torchrun has no equivalent (no central view of the ranks' steps): gelastic only.
"""

from __future__ import annotations

import dataclasses
import time

from bench._common import GELASTIC, Measurement, log
from bench._simnodes import (
    CoordinatorProcess,
    SimFleet,
    cpu_seconds,
    sim_job_spec,
    wait_round_started,
)
from client import Client

SCENARIO = "progress_load"
SIZES = (1000,)
QUICK_SIZES = (50,)
RANKS_PER_NODE = 8
STEP_HZ = 10.0
WARMUP_S, QUICK_WARMUP_S = 5.0, 1.0
WINDOW_S, QUICK_WINDOW_S = 15.0, 3.0
MAX_WINDOWS = 3
LEASE_S = 10.0


def _timeout(n: int) -> float:
    return 60.0 + n / 20


def _cpu_window(coord: CoordinatorProcess, fleet: SimFleet, window: float) -> tuple[float, float]:
    """(coordinator cores, progress reports per second) over one window."""
    cproc = coord.process()
    r0, c0, w0 = fleet.stats().progress_reports, cpu_seconds(cproc), time.monotonic()
    time.sleep(window)
    wall = time.monotonic() - w0
    c1, r1 = cpu_seconds(cproc), fleet.stats().progress_reports
    return (c1 - c0) / wall, (r1 - r0) / wall


def _measure(n: int, windows: int, quick: bool) -> list[Measurement]:
    label = f"N={n} x{RANKS_PER_NODE}"
    base_m = Measurement(SCENARIO, f"{label} coordinator CPU, heartbeats only (cores)", GELASTIC)
    prog_m = Measurement(
        SCENARIO, f"{label} coordinator CPU, progress at {STEP_HZ:g} Hz (cores)", GELASTIC
    )
    status_m = Measurement(SCENARIO, f"{label} status with progress (s)", GELASTIC)
    coord = CoordinatorProcess(lease=LEASE_S, heartbeat_interval=1.0)
    fleet = SimFleet(coord.address, n, processes=2, slots=RANKS_PER_NODE, health=True)
    client: Client | None = None
    try:
        coord.start()
        fleet.address = coord.address
        client = Client(coord.address)
        fleet.start()
        fleet.wait_welcomed(_timeout(n))
        base = sim_job_spec(n, RANKS_PER_NODE, name=f"bench-progress-{n}")
        spec = dataclasses.replace(base, stall_timeout=60.0)
        job = client.submit(spec)
        times = wait_round_started(fleet, client, job.job_id, _timeout(n))
        if times.all_started is None:
            raise TimeoutError(f"only {times.started}/{n} nodes started within {_timeout(n):g} s")
        time.sleep(QUICK_WARMUP_S if quick else WARMUP_S)
        window = QUICK_WINDOW_S if quick else WINDOW_S
        for i in range(windows):
            cores, _ = _cpu_window(coord, fleet, window)
            base_m.add(cores)
            log(f"  {SCENARIO} {label} heartbeats only, window {i + 1}: {cores:.3f} cores")
        fleet.set_progress(STEP_HZ)
        time.sleep(QUICK_WARMUP_S if quick else WARMUP_S)
        rates = []
        for i in range(windows):
            cores, rate = _cpu_window(coord, fleet, window)
            prog_m.add(cores)
            rates.append(rate)
            log(
                f"  {SCENARIO} {label} progress, window {i + 1}: {cores:.3f} cores, "
                f"{rate:.0f} reports/s"
            )
        for _ in range(windows):
            t0 = time.perf_counter()
            status = client.job(job.job_id).status()
            status_m.add(time.perf_counter() - t0)
        stepped = sum(1 for w in status.workers if w.step)
        extra = (prog_m.median or 0.0) - (base_m.median or 0.0)
        mean_rate = sum(rates) / len(rates)
        prog_m.note = (
            f"{min(rates):.0f}-{max(rates):.0f} ProgressReports/s ({RANKS_PER_NODE} ranks each, "
            f"{STEP_HZ:g} steps/s per rank); +{extra:.3f} cores over heartbeats only, "
            f"{1e6 * extra / mean_rate if mean_rate else 0:.0f} us of coordinator CPU a report; "
            f"{stepped}/{len(status.workers)} ranks with a step in status; job "
            f"{status.state.value}, {'stalled' if status.stalled else 'not stalled'}"
        )
        if stepped != len(status.workers) or status.stalled:
            raise AssertionError(f"{SCENARIO}: {prog_m.note}")
    finally:
        if client is not None:
            client.close()
        coord.stop(grace=5.0)
        fleet.stop()
    return [base_m, prog_m, status_m]


def run(runs: int, quick: bool) -> list[Measurement]:
    out: list[Measurement] = []
    for n in QUICK_SIZES if quick else SIZES:
        out += _measure(n, min(runs, MAX_WINDOWS), quick)
    return out
