"""rendezvous_scale: from submitting an N-node job to every node holding its assignment.

A fresh `coordinator serve` process per run (lease 30 s, heartbeat 5 s, so leases never come
into it) and N simulated nodes (`_simnodes.py`: the real NodeSession protocol, many nodes per
process, 1 process up to 100 nodes, 2 up to 10,000, one per 5,000 beyond). Once ListNodes
shows all N live, one job of N nodes x 1 worker (`last_call_timeout=0`) is submitted:

- `N=n submit -> all assigned`: `submit()` -> the last simulated node's receive time of its
  Assign (`time.time()` in the node's process, max over the nodes). It includes the master
  port reservation on group rank 0 (answered at once).
- `N=n submit -> all started`: `submit()` -> the coordinator's timestamp of the round's
  `round_started` event (it has processed every node's WorkersStarted).
- `N=n coordinator peak RSS (MB)`: VmHWM of the coordinator process at the end of the run.
- `N=n registration`: the simulated nodes start -> all N welcomed (they connect all at once;
  the note counts attempts the coordinator refused, which the nodes retry with backoff).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from bench._common import GELASTIC, Measurement, log
from bench._simnodes import CoordinatorProcess, SimFleet, sim_job_spec, wait_round_started
from client import Client

SCENARIO = "rendezvous_scale"
SIZES = (10, 100, 1000, 5000, 10000)
QUICK_SIZES = (10,)
BIG = 5000
"""From this size on a run takes minutes: at most BIG_RUNS runs."""
BIG_RUNS = 3
MB = 1024 * 1024


@dataclass
class _Run:
    registration: float
    refused: int
    refused_why: dict[str, int]
    assigned: float | None
    started: float | None
    peak_rss: int
    fleet_rss: int
    detail: str


NODES_PER_PROCESS = 5000
"""Above this many nodes the fleet takes one more simulator process per this many."""


def _fleet_processes(n: int) -> int:
    return 1 if n <= 100 else max(2, math.ceil(n / NODES_PER_PROCESS))


def _timeout(n: int) -> float:
    return 30.0 + n / 50


def _one_run(n: int) -> _Run:
    coord = CoordinatorProcess(lease=30.0, heartbeat_interval=5.0)
    fleets: list[SimFleet] = []
    client: Client | None = None
    try:
        coord.start()
        client = Client(coord.address)
        t_reg = time.monotonic()
        fleet = SimFleet(coord.address, n, processes=_fleet_processes(n))
        fleets.append(fleet)
        fleet.start()
        reg = fleet.wait_welcomed(_timeout(n))
        registration = time.monotonic() - t_reg
        live = sum(1 for node in client.list_nodes() if node.state == "live")
        if live != n:
            raise RuntimeError(f"ListNodes shows {live} live nodes, expected {n}")

        t0 = time.time()
        job = client.submit(sim_job_spec(n, name=f"bench-rdzv-{n}"))
        times = wait_round_started(fleet, client, job.job_id, _timeout(n))
        detail = f"{times.assigned}/{n} assigned, {times.started}/{n} started"
        peak = coord.peak_rss()
        fleet_rss = sum(p.memory_info().rss for p in fleet.psutil_procs())
        after = fleet.stats()
        if after.ended:
            # Kept as a result, not an error: a coordinator too busy to read the nodes'
            # messages within the lease drops them, which is what this scenario is there to show.
            out = coord.output()
            detail += (
                f"; {after.ended} SESSIONS DROPPED by the coordinator "
                f"({out.count('lease expired')} 'lease expired' in its log)"
            )
        return _Run(
            registration=registration,
            refused=reg.refused,
            refused_why=reg.refused_why,
            assigned=None if times.all_assigned is None else times.all_assigned - t0,
            started=None if times.all_started is None else times.all_started - t0,
            peak_rss=peak,
            fleet_rss=fleet_rss,
            detail=detail,
        )
    finally:
        if client is not None:
            client.close()
        # The coordinator first: a fleet leaving first would make it process N node losses.
        coord.stop(grace=5.0)
        for f in fleets:
            f.stop()


def run(runs: int, quick: bool, sizes: tuple[int, ...] | None = None) -> list[Measurement]:
    """Measure each size (default SIZES; --quick: QUICK_SIZES)."""
    if sizes is None:
        sizes = QUICK_SIZES if quick else SIZES
    out: list[Measurement] = []
    for n in sizes:
        count = runs if n < BIG else min(runs, BIG_RUNS)
        assigned = Measurement(SCENARIO, f"N={n} submit -> all assigned", GELASTIC)
        started = Measurement(SCENARIO, f"N={n} submit -> all started", GELASTIC)
        rss = Measurement(SCENARIO, f"N={n} coordinator peak RSS (MB)", GELASTIC)
        reg = Measurement(SCENARIO, f"N={n} registration", GELASTIC)
        refused: list[int] = []
        fleet_mb: list[float] = []
        dropped: list[str] = []
        for i in range(count):
            r = _one_run(n)
            assigned.add(r.assigned)
            started.add(r.started)
            rss.add(r.peak_rss / MB)
            reg.add(r.registration)
            refused.append(r.refused)
            fleet_mb.append(r.fleet_rss / MB)
            if "DROPPED" in r.detail:
                dropped.append(f"run {i + 1}: {r.detail}")
            log(
                f"  {SCENARIO} N={n} run {i + 1}/{count}: assigned "
                + ("timed out" if r.assigned is None else f"{r.assigned:.3f} s")
                + ", started "
                + ("timed out" if r.started is None else f"{r.started:.3f} s")
                + f" ({r.detail}); coordinator peak RSS {r.peak_rss / MB:.0f} MB; "
                f"registration {r.registration:.2f} s ({r.refused} attempts refused"
                + (f": {r.refused_why}" if r.refused_why else "")
                + ")"
            )
        notes = [f"{count} runs, not {runs}: a run at this size takes minutes"]
        assigned.note = "; ".join((notes if count < runs else []) + dropped)
        reg.note = (
            f"all N connect at once; attempts refused by the coordinator and retried: "
            f"{', '.join(map(str, refused))}; simulated nodes' RSS "
            f"{max(fleet_mb):.0f} MB (all fleet processes)"
        )
        out += [assigned, started, rss, reg]
    return out
