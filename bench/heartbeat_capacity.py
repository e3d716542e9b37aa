"""heartbeat_capacity: the coordinator's CPU while N agents heartbeat at 1 Hz.

A fresh `coordinator serve` process per size (heartbeat 1 s, lease 10 s) and N simulated nodes
(`_simnodes.py`) in 2 processes of their own, 2 slots each. One job of N nodes x 2 workers
runs on them, so every heartbeat carries a GroupHealth with two worker samples (pid, CPU%,
RSS, state) for the round the node holds, which the coordinator files under those ranks. Each
node heartbeats once a second, the nodes of a process spread evenly over the second.

After every node has started its workers and a warm-up, the CPU time (user + system,
psutil) of each process is read over a window of wall time:

- `N=n coordinator CPU (cores)`: the coordinator's CPU seconds per wall second.
- `N=n simulated agents CPU (cores)`: the same for the simulated nodes' processes together.
- `N=n host CPU busy (cores)`: the whole host (of os.cpu_count() cores), so a reader can tell
  whether the machine was saturated; `heartbeats/s` in the note is what the simulated nodes
  actually sent (N when nothing starves them).

Each window is one sample; windows follow one another on the same cluster. Nodes lost while
heartbeating (an overloaded coordinator missing leases) are reported in the note, loudly.
"""

from __future__ import annotations

import os
import time

import psutil

from bench._common import GELASTIC, Measurement, log
from bench._simnodes import (
    CoordinatorProcess,
    SimFleet,
    cpu_seconds,
    sim_job_spec,
    wait_round_started,
)
from client import Client

SCENARIO = "heartbeat_capacity"
SIZES = (1000, 5000)
QUICK_SIZES = (100,)
WORKERS_PER_NODE = 2
WARMUP_S, QUICK_WARMUP_S = 5.0, 1.0
WINDOW_S, QUICK_WINDOW_S = 20.0, 3.0
MAX_WINDOWS = 3
"""Windows per size, whatever --runs says: each costs WINDOW_S of wall time."""
LEASE_S = 10.0


def _host_busy() -> float:
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def _timeout(n: int) -> float:
    return 60.0 + n / 20


def _measure(n: int, windows: int, quick: bool) -> list[Measurement]:
    coord_m = Measurement(SCENARIO, f"N={n} coordinator CPU (cores)", GELASTIC)
    fleet_m = Measurement(SCENARIO, f"N={n} simulated agents CPU (cores)", GELASTIC)
    host_m = Measurement(SCENARIO, f"N={n} host CPU busy (cores)", GELASTIC)
    coord = CoordinatorProcess(lease=LEASE_S, heartbeat_interval=1.0)
    fleets: list[SimFleet] = []
    client: Client | None = None
    try:
        coord.start()
        client = Client(coord.address)
        fleet = SimFleet(coord.address, n, processes=2, slots=WORKERS_PER_NODE, health=True)
        fleets.append(fleet)
        fleet.start()
        fleet.wait_welcomed(_timeout(n))
        job = client.submit(sim_job_spec(n, WORKERS_PER_NODE, name=f"bench-heartbeat-{n}"))
        times = wait_round_started(fleet, client, job.job_id, _timeout(n))
        if times.all_started is None:
            raise TimeoutError(
                f"only {times.started}/{n} nodes started their workers within {_timeout(n):g} s"
            )
        time.sleep(QUICK_WARMUP_S if quick else WARMUP_S)

        cproc = coord.process()
        fprocs = fleet.psutil_procs()
        window = QUICK_WINDOW_S if quick else WINDOW_S
        rates: list[float] = []
        others: list[float] = []
        for i in range(windows):
            beats0 = fleet.stats().heartbeats
            c0, f0, h0 = cpu_seconds(cproc), sum(map(cpu_seconds, fprocs)), _host_busy()
            w0 = time.monotonic()
            time.sleep(window)
            wall = time.monotonic() - w0
            c1, f1, h1 = cpu_seconds(cproc), sum(map(cpu_seconds, fprocs)), _host_busy()
            beats1 = fleet.stats().heartbeats
            coord_m.add((c1 - c0) / wall)
            fleet_m.add((f1 - f0) / wall)
            host_m.add((h1 - h0) / wall)
            rates.append((beats1 - beats0) / wall)
            others.append((h1 - h0 - (c1 - c0) - (f1 - f0)) / wall)
            log(
                f"  {SCENARIO} N={n} window {i + 1}/{windows} ({wall:.1f} s): coordinator "
                f"{(c1 - c0) / wall:.3f} cores, simulated agents {(f1 - f0) / wall:.3f} cores, "
                f"host {(h1 - h0) / wall:.2f}/{os.cpu_count()} cores busy, "
                f"{rates[-1]:.0f} heartbeats/s"
            )

        after = fleet.stats()
        live = sum(1 for node in client.list_nodes() if node.state == "live")
        status = client.job(job.job_id).status()
        coord_m.note = (
            f"{min(rates):.0f}-{max(rates):.0f} heartbeats/s sent ({WORKERS_PER_NODE} worker "
            f"samples each); {live}/{n} nodes live and {after.ended} sessions dropped at the "
            f"end; job {status.state.value}; coordinator RSS "
            f"{cproc.memory_info().rss / 2**20:.0f} MB"
        )
        host_m.note = (
            f"of {os.cpu_count()} cores; processes other than the coordinator and the "
            f"simulated agents: {min(others):.2f}-{max(others):.2f} cores"
        )
        if live != n or after.ended:
            # Kept as a result, not an error: an overloaded coordinator losing nodes is what
            # this scenario is there to show.
            log(f"  {SCENARIO} N={n}: NODES LOST while heartbeating; {after.errors[:3]}")
            coord_m.note = "NODES LOST: " + coord_m.note
    finally:
        if client is not None:
            client.close()
        coord.stop(grace=5.0)
        for f in fleets:
            f.stop()
    return [coord_m, fleet_m, host_m]


def run(runs: int, quick: bool) -> list[Measurement]:
    out: list[Measurement] = []
    for n in QUICK_SIZES if quick else SIZES:
        out += _measure(n, min(runs, MAX_WINDOWS), quick)
    return out
