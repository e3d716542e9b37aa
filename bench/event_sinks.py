"""event_sinks: what coordinator event sinks cost a coordinator that submits as fast as it can.

The `submit_throughput` run (a fresh `coordinator serve`, no agents, M jobs of a trivial spec
from 8 client threads, each Submit answered once its job is on disk; every Submit records one
`submitted` event), with the coordinator given:

- no sink;
- `--event-log FILE`, the JSON-lines file sink (a fresh file per run);
- `--event-sink bench._hanging_sink:hang`, a sink that never returns from its first event: the
  events that do not fit its queue are dropped, and Submit must not slow down.

`jobs/s` per configuration, M = 500 (`--quick`: 100). No torchrun equivalent: torch's
`--event-log-handler` runs in its agent, per agent event, not for a scheduler.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench._common import GELASTIC, Measurement, log
from bench.submit_throughput import one_run

SCENARIO = "event_sinks"
JOBS = 500
QUICK_JOBS = 100
THREADS = 8


def _configs(tmp: Path, run: int) -> dict[str, tuple[str, ...]]:
    return {
        "no sink": (),
        "--event-log": ("--event-log", str(tmp / f"events-{run}.jsonl")),
        "a hanging --event-sink": ("--event-sink", "bench._hanging_sink:hang"),
    }


def run(runs: int, quick: bool) -> list[Measurement]:
    jobs = QUICK_JOBS if quick else JOBS
    out: dict[str, Measurement] = {}
    lat: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gelastic-bench-sinks-") as d:
        for i in range(runs):
            for name, extra in _configs(Path(d), i).items():
                m = out.setdefault(
                    name, Measurement(SCENARIO, f"{name}: jobs/s ({jobs} jobs)", GELASTIC)
                )
                r = one_run(jobs, THREADS, extra=extra)
                m.add(r.rate)
                lat.setdefault(name, []).append(statistics.median(r.latencies) * 1000)
                log(f"  {SCENARIO} {name} run {i + 1}/{runs}: {r.rate:.0f} jobs/s")
    for name, m in out.items():
        m.note = f"unit jobs/s, not s; submit latency median {statistics.median(lat[name]):.1f} ms"
    return list(out.values())
