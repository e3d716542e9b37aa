"""cold_start: from submitting a job to its workers running, and to its RunResult.

The workers exit 0 at once (`_worker.py` in mode `exit`); each writes a timestamp at its first
line. For gelastic the clock starts right before `submit()` on an already running LocalCluster
(one cluster for all runs; only the job is timed):

- `workers started`: submit() -> the last worker's first line (max over the worker stamps).
- `result visible`: submit() -> `job.poll()` (polled every 10 ms) returns the RunResult.

torchrun (2x2 only) runs the same script: two launchers on 127.0.0.1 with a c10d rendezvous,
the clock starting right before the first is launched, so it includes their interpreter and
torch import (torchrun has no standing agents). `result visible` is both launchers exited.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench._common import (
    GELASTIC,
    PY,
    TORCH,
    WORKER,
    Measurement,
    RunDirs,
    TorchrunGroup,
    gelastic_cluster,
    log,
    poll_result,
    read_starts,
    worker_env,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "cold_start"
TIMEOUT = 60.0


def _gelastic_run(
    cluster: LocalCluster, run_dir: Path, nodes: int, nproc: int
) -> tuple[float, float]:
    spec = JobSpec(
        entrypoint=[PY, WORKER],
        nproc_per_node=nproc,
        min_nodes=nodes,
        max_nodes=nodes,
        env=worker_env(run_dir, "exit"),
        name=f"bench-cold-{nodes}x{nproc}",
    )
    t0 = time.time()
    job = cluster.client.submit(spec)
    result, seen = poll_result(job, TIMEOUT)
    if result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"cold start job failed:\n{result.format_failures()}")
    stamps = read_starts(run_dir)
    if len(stamps) != nodes * nproc:
        raise RuntimeError(f"expected {nodes * nproc} worker stamps, found {len(stamps)}")
    return max(s.t for s in stamps) - t0, seen - t0


def _torchrun_run(run_dir: Path, nodes: int, nproc: int) -> tuple[float, float]:
    with TorchrunGroup(
        count=nodes,
        nnodes=str(nodes),
        nproc_per_node=nproc,
        max_restarts=0,
        env=worker_env(run_dir, "exit"),
        log_dir=run_dir,
    ) as group:
        t0 = group.start()
        if not group.wait(TIMEOUT):
            raise TimeoutError(f"torchrun did not finish within {TIMEOUT:g} s")
        if any(rc != 0 for rc in group.returncodes()):
            raise RuntimeError(f"torchrun failed: return codes {group.returncodes()}")
        done = max(group.exit_times.values())
    stamps = read_starts(run_dir)
    if len(stamps) != nodes * nproc:
        raise RuntimeError(f"expected {nodes * nproc} worker stamps, found {len(stamps)}")
    return max(s.t for s in stamps) - t0, done - t0


def run(runs: int, quick: bool) -> list[Measurement]:
    sizes = [(2, 2)] if quick else [(2, 2), (4, 1)]
    started = {
        size: Measurement(SCENARIO, f"{size[0]}x{size[1]} workers started", GELASTIC)
        for size in sizes
    }
    visible = {
        size: Measurement(SCENARIO, f"{size[0]}x{size[1]} result visible", GELASTIC)
        for size in sizes
    }
    t_started = Measurement(SCENARIO, "2x2 workers started", TORCH)
    t_visible = Measurement(SCENARIO, "2x2 result visible", TORCH, note="both launchers exited")
    with RunDirs(SCENARIO) as dirs, gelastic_cluster(nodes=max(n for n, _ in sizes)) as cluster:
        if not quick:
            # One untimed job each, so no run pays for a cold page cache.
            _gelastic_run(cluster, dirs.new("warmup"), 2, 2)
            _torchrun_run(dirs.new("warmup-torchrun"), 2, 2)
        for i in range(runs):
            for nodes, nproc in sizes:
                s, v = _gelastic_run(cluster, dirs.new(f"g{nodes}x{nproc}"), nodes, nproc)
                started[(nodes, nproc)].add(s)
                visible[(nodes, nproc)].add(v)
                log(
                    f"  {SCENARIO} run {i + 1}/{runs} gelastic {nodes}x{nproc}: "
                    f"started {s:.3f} s, result {v:.3f} s"
                )
            s, v = _torchrun_run(dirs.new("t2x2"), 2, 2)
            t_started.add(s)
            t_visible.add(v)
            log(
                f"  {SCENARIO} run {i + 1}/{runs} torchrun 2x2: started {s:.3f} s, exited {v:.3f} s"
            )
    out: list[Measurement] = []
    for size in sizes:
        out += [started[size], visible[size]]
        if size == (2, 2):
            out += [t_started, t_visible]
    return out
