"""torch_failure: from a torch rank raising under `@record` to the failed RunResult at the client.

A job with max_restarts=0 of `_torch_worker.py` in mode `raise`: every rank runs
init_process_group(gloo) + one all_reduce; once all are past it (plus 0.5 s), rank 1 writes the
failure time and raises RuntimeError inside torch's `@record`, which writes torchelastic's error
file before the exception ends the process; the others sleep on. Sizes 2x2 and 2x4 (`--quick`:
2x2), a LocalCluster of exactly the job's nodes per size.

- `NxM raise -> FAILED at the client (poll)` (gelastic): the failure stamp -> `job.poll()`,
  called every 10 ms, returns a failed RunResult whose root cause is checked to be rank 1, exit
  code 1, with the exception's message (from the error file).
- `NxM raise -> FAILED at the client (wait)` (gelastic): the same with a separate job, the client
  blocked in `job.wait()` (not run with `--quick`).

torchrun runs the same script with `--max-restarts 0` on one launcher per node:
`raise -> FAILED at the client (poll)` is the failure -> the failing node's launcher exits
(having printed the ChildFailedError report with the error file's traceback).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench._common import (
    GELASTIC,
    PY,
    TORCH,
    TORCH_ENV,
    TORCH_WORKER,
    Measurement,
    RunDirs,
    TorchrunGroup,
    gelastic_cluster,
    log,
    poll_result,
    read_event,
    size_runs,
    torch_torchrun_group,
    worker_env,
)
from client import Job, JobSpec, RunResult
from gelastic.local import LocalCluster

SCENARIO = "torch_failure"
TIMEOUT = 120.0
MESSAGE = "failing on purpose"


def _by_wait(job: Job) -> tuple[RunResult, float]:
    result = job.wait(TIMEOUT)
    return result, time.time()


def _by_poll(job: Job) -> tuple[RunResult, float]:
    return poll_result(job, TIMEOUT)


def _gelastic_run(
    cluster: LocalCluster,
    run_dir: Path,
    nodes: int,
    nproc: int,
    follow: Callable[[Job], tuple[RunResult, float]],
) -> float:
    spec = JobSpec(
        entrypoint=[PY, TORCH_WORKER],
        nproc_per_node=nproc,
        min_nodes=nodes,
        max_nodes=nodes,
        max_restarts=0,
        last_call_timeout=0,
        env=worker_env(run_dir, "raise", BENCH_CRASH_RANK="1", **TORCH_ENV),
        name=f"bench-torch-raise-{nodes}x{nproc}",
    )
    job = cluster.client.submit(spec)
    result, seen = follow(job)
    crash = read_event(run_dir)
    if not result.is_failed() or crash is None:
        raise RuntimeError(
            f"expected a failed job with a failure stamp, got {result.state}, {crash}"
        )
    root = result.root_cause
    if root is None or root.global_rank != 1 or root.exitcode != 1 or MESSAGE not in root.message:
        raise RuntimeError(f"wrong root cause: {root}")
    return seen - crash


def _torchrun_run(run_dir: Path, nodes: int, nproc: int) -> tuple[float | None, list[int | None]]:
    group: TorchrunGroup
    with torch_torchrun_group(
        count=nodes,
        nnodes=str(nodes),
        nproc_per_node=nproc,
        max_restarts=0,
        env=worker_env(run_dir, "raise", BENCH_CRASH_RANK="1", **TORCH_ENV),
        log_dir=run_dir,
    ) as group:
        group.start()
        group.wait(TIMEOUT, lambda g: len(g.running()) < nodes)
        first = min(group.exit_times.values(), default=None)
        codes = group.returncodes()
    crash = read_event(run_dir)
    if crash is None or first is None:
        return None, codes
    return first - crash, codes


def run(runs: int, quick: bool) -> list[Measurement]:
    sizes = [(2, 2)] if quick else [(2, 2), (2, 4)]
    out: list[Measurement] = []
    with RunDirs(SCENARIO) as dirs:
        for nodes, nproc in sizes:
            size = f"{nodes}x{nproc}"
            g_poll = Measurement(SCENARIO, f"{size} raise -> FAILED at the client (poll)", GELASTIC)
            g_wait = Measurement(SCENARIO, f"{size} raise -> FAILED at the client (wait)", GELASTIC)
            t_first = Measurement(
                SCENARIO,
                f"{size} raise -> FAILED at the client (poll)",
                TORCH,
                note="the failing node's launcher exited",
            )
            codes_seen: set[str] = set()
            with gelastic_cluster(nodes=nodes, slots=nproc) as cluster:
                n_runs = size_runs(runs, nodes * nproc)
                for i in range(n_runs):
                    p = _gelastic_run(cluster, dirs.new(f"gpoll{size}"), nodes, nproc, _by_poll)
                    g_poll.add(p)
                    msg = f"poll {p:.3f} s"
                    if not quick:
                        w = _gelastic_run(cluster, dirs.new(f"gwait{size}"), nodes, nproc, _by_wait)
                        g_wait.add(w)
                        msg += f", wait {w:.3f} s"
                    log(f"  {SCENARIO} run {i + 1}/{n_runs} gelastic {size}: {msg}")
                    first, codes = _torchrun_run(dirs.new(f"t{size}"), nodes, nproc)
                    t_first.add(first)
                    codes_seen.add(str(codes))
                    shown = "timed out" if first is None else f"{first:.3f} s"
                    log(
                        f"  {SCENARIO} run {i + 1}/{n_runs} torchrun {size}: failing launcher exited {shown}"
                    )
            t_first.note += (
                f"; exit codes (None = killed at teardown) {', '.join(sorted(codes_seen))}"
            )
            out += [g_poll, *([g_wait] if not quick else []), t_first]
    return out
