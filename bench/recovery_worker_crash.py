"""recovery_worker_crash: from a worker crashing to every worker of the next attempt running.

A 2x2 job (and a 2x1 one) with max_restarts=1 of `_worker.py` in mode `crash`: once all four workers of attempt
0 run (plus 0.5 s, so the crash hits a running job), rank 1 writes the crash time and exits 1;
the other ranks sleep as if training. The workers of attempt 1 see the crash file, write their
start time and exit 0, so the job then succeeds.

- `crash -> restarted`: the crash timestamp -> the last attempt-1 worker's first line. It
  includes noticing the exit, stopping the three other workers (SIGTERM; they die at once),
  the new rendezvous and starting four processes.
- `crash -> result visible` (gelastic): the crash -> `job.poll()` returns the successful result.

torchrun runs the same script with `--max-restarts 1` on two launchers; its measurement stops
at the same worker-side timestamp.
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
    read_event,
    read_starts,
    wait_starts,
    worker_env,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "recovery_worker_crash"
TIMEOUT = 60.0
NODES = 2
SIZES, QUICK_SIZES = (2, 1), (2,)
"""Workers per node: one job per size, each on the 2 nodes."""


def _restart_counts(run_dir: Path) -> str:
    """TORCHELASTIC_RESTART_COUNT as the attempt-1 workers saw it, by rank."""
    later = sorted((s.rank, s.restart) for s in read_starts(run_dir) if s.later)
    return " ".join(f"{rank}:{restart}" for rank, restart in later)


def _gelastic_run(cluster: LocalCluster, run_dir: Path, nproc: int) -> tuple[float, float]:
    spec = JobSpec(
        entrypoint=[PY, WORKER],
        nproc_per_node=nproc,
        min_nodes=NODES,
        max_nodes=NODES,
        max_restarts=1,
        env=worker_env(run_dir, "crash", BENCH_CRASH_RANK="1"),
        name="bench-crash",
    )
    job = cluster.client.submit(spec)
    result, seen = poll_result(job, TIMEOUT)
    if result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"the restarted job did not succeed:\n{result.format_failures()}")
    if [a.attempt for a in result.attempts] != [0, 1]:
        raise RuntimeError(f"expected attempts 0 and 1, got {result.attempts}")
    crash = read_event(run_dir)
    later = [s for s in read_starts(run_dir) if s.later]
    if crash is None or len(later) != NODES * nproc:
        raise RuntimeError(f"crash stamp {crash}, {len(later)} attempt-1 stamps")
    return max(s.t for s in later) - crash, seen - crash


def _torchrun_run(run_dir: Path, nproc: int) -> tuple[float | None, list[int | None]]:
    with TorchrunGroup(
        count=NODES,
        nnodes=str(NODES),
        nproc_per_node=nproc,
        max_restarts=1,
        env=worker_env(run_dir, "crash", BENCH_CRASH_RANK="1"),
        log_dir=run_dir,
    ) as group:
        group.start()
        later = wait_starts(
            run_dir, NODES * nproc, TIMEOUT, later=True, alive=lambda: bool(group.running())
        )
        group.wait(TIMEOUT)
        codes = group.returncodes()
    crash = read_event(run_dir)
    if later is None or crash is None:
        return None, codes
    return max(s.t for s in later) - crash, codes


def run(runs: int, quick: bool) -> list[Measurement]:
    sizes = QUICK_SIZES if quick else SIZES
    out: list[Measurement] = []
    with RunDirs(SCENARIO) as dirs, gelastic_cluster(nodes=NODES) as cluster:
        for nproc in sizes:
            out += _run_size(cluster, dirs, nproc, runs)
    return out


def _run_size(cluster: LocalCluster, dirs: RunDirs, nproc: int, runs: int) -> list[Measurement]:
    size = f"{NODES}x{nproc}"
    # The 2x2 metrics keep their names, so earlier results compare.
    suffix = "" if nproc == 2 else f" ({size})"
    g_restart = Measurement(SCENARIO, f"crash -> restarted{suffix}", GELASTIC)
    g_result = Measurement(SCENARIO, f"crash -> result visible{suffix}", GELASTIC)
    t_restart = Measurement(SCENARIO, f"crash -> restarted{suffix}", TORCH)
    torch_codes: set[str] = set()
    counts: dict[str, set[str]] = {GELASTIC: set(), TORCH: set()}
    for i in range(runs):
        g_dir = dirs.new(f"g{size}")
        r, v = _gelastic_run(cluster, g_dir, nproc)
        counts[GELASTIC].add(_restart_counts(g_dir))
        g_restart.add(r)
        g_result.add(v)
        log(
            f"  {SCENARIO} {size} run {i + 1}/{runs} gelastic: restarted {r:.3f} s, result {v:.3f} s"
        )
        time.sleep(0.2)
        t_dir = dirs.new(f"t{size}")
        tr, codes = _torchrun_run(t_dir, nproc)
        counts[TORCH].add(_restart_counts(t_dir))
        t_restart.add(tr)
        torch_codes.add(str(codes))
        shown = "timed out" if tr is None else f"{tr:.3f} s"
        log(
            f"  {SCENARIO} {size} run {i + 1}/{runs} torchrun: restarted {shown}, exit codes {codes}"
        )
    for m in (g_restart, t_restart):
        seen = " | ".join(sorted(counts[m.system]))
        m.note = f"TORCHELASTIC_RESTART_COUNT of attempt 1 by rank: {seen}"
    t_restart.note += f"; launcher exit codes {', '.join(sorted(torch_codes))}"
    return [g_restart, g_result, t_restart]
