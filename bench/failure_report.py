"""failure_report: from a worker crashing with no restarts left to the failure reaching the user.

A 2x2 job with max_restarts=0 of `_worker.py` in mode `crash`: once all four workers run (plus
0.5 s), rank 1 writes the crash time right before it exits 1; the other ranks sleep on.

- `crash -> result visible (poll)` (gelastic): the crash timestamp -> `job.poll()`, called every
  10 ms, returns a failed RunResult (checked: rank 1 is its root cause). It includes noticing the
  exit, stopping the three sleeping workers on both nodes and the client's next poll.
- `crash -> result visible (wait)` (gelastic): the same with a separate job, the client blocked
  in `job.wait()` (a server-side watch stream) instead of polling.

torchrun runs the same script with `--max-restarts 0` on two launchers:

- `crash -> result visible (poll)`: the crash -> the first launcher exits (the one whose worker
  failed; it has printed the ChildFailedError report).
- `crash -> all launchers exited`: the other launcher is never told; it runs on until its own
  workers end. With workers that make no collective calls that is never, so this times out
  after 10 s (3 s with --quick; then everything is killed). A real DDP job would fail there
  on its next collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    worker_env,
)
from client import Job, JobSpec, RunResult
from gelastic.local import LocalCluster

SCENARIO = "failure_report"
TIMEOUT = 60.0
HANG_TIMEOUT = 10.0
QUICK_HANG_TIMEOUT = 3.0
NODES, NPROC = 2, 2


def _by_wait(job: Job) -> tuple[RunResult, float]:
    result = job.wait(TIMEOUT)
    return result, time.time()


def _by_poll(job: Job) -> tuple[RunResult, float]:
    return poll_result(job, TIMEOUT)


def _gelastic_run(
    cluster: LocalCluster, run_dir: Path, follow: Callable[[Job], tuple[RunResult, float]]
) -> float:
    spec = JobSpec(
        entrypoint=[PY, WORKER],
        nproc_per_node=NPROC,
        min_nodes=NODES,
        max_nodes=NODES,
        max_restarts=0,
        env=worker_env(run_dir, "crash", BENCH_CRASH_RANK="1"),
        name="bench-failure",
    )
    job = cluster.client.submit(spec)
    result, seen = follow(job)
    crash = read_event(run_dir)
    if not result.is_failed() or crash is None:
        raise RuntimeError(f"expected a failed job with a crash stamp, got {result.state}, {crash}")
    root = result.root_cause
    if root is None or root.global_rank != 1 or root.exitcode != 1:
        raise RuntimeError(f"wrong root cause: {root}")
    return seen - crash


def _torchrun_run(
    run_dir: Path, hang: float
) -> tuple[float | None, float | None, list[int | None], bool]:
    """(crash -> first exit, crash -> last exit, exit codes, the failed node hosted the store)."""
    with TorchrunGroup(
        count=NODES,
        nnodes=str(NODES),
        nproc_per_node=NPROC,
        max_restarts=0,
        env=worker_env(run_dir, "crash", BENCH_CRASH_RANK="1"),
        log_dir=run_dir,
    ) as group:
        group.start()
        host: list[int | None] = [None]

        def first_exit(g: TorchrunGroup) -> bool:
            if host[0] is None:
                host[0] = g.store_host()
            return len(g.running()) < NODES

        group.wait(TIMEOUT, first_exit)
        first = min(group.exit_times.values(), default=None)
        failed_hosted = (
            first is not None and min(group.exit_times, key=group.exit_times.__getitem__) == host[0]
        )
        group.wait(hang)
        last = max(group.exit_times.values()) if not group.running() else None
        codes = group.returncodes()
    crash = read_event(run_dir)
    if crash is None or first is None:
        return None, None, codes, failed_hosted
    return first - crash, None if last is None else last - crash, codes, failed_hosted


def run(runs: int, quick: bool) -> list[Measurement]:
    g_poll = Measurement(SCENARIO, "crash -> result visible (poll)", GELASTIC)
    g_wait = Measurement(SCENARIO, "crash -> result visible (wait)", GELASTIC)
    t_first = Measurement(
        SCENARIO, "crash -> result visible (poll)", TORCH, note="the failing node's launcher exited"
    )
    t_all = Measurement(SCENARIO, "crash -> all launchers exited", TORCH)
    hang = QUICK_HANG_TIMEOUT if quick else HANG_TIMEOUT
    codes_seen: set[str] = set()
    hosted = {True: 0, False: 0}
    with RunDirs(SCENARIO) as dirs, gelastic_cluster(nodes=NODES) as cluster:
        for i in range(runs):
            p = _gelastic_run(cluster, dirs.new("gpoll"), _by_poll)
            g_poll.add(p)
            msg = f"poll {p:.3f} s"
            if not quick:
                w = _gelastic_run(cluster, dirs.new("gwait"), _by_wait)
                g_wait.add(w)
                msg += f", wait {w:.3f} s"
            log(f"  {SCENARIO} run {i + 1}/{runs} gelastic: {msg}")
            first, last, codes, failed_hosted = _torchrun_run(dirs.new("t"), hang)
            hosted[failed_hosted] += 1
            t_first.add(first)
            t_all.add(last)
            codes_seen.add(str(codes))
            shown = [
                f"{v:.3f} s" if v is not None else f"not within {hang:g} s" for v in (first, last)
            ]
            log(
                f"  {SCENARIO} run {i + 1}/{runs} torchrun: first launcher exit {shown[0]}, "
                f"all {shown[1]}, exit codes {codes}, failed node hosted the store: {failed_hosted}"
            )
    t_all.note = (
        f"timed out = the other launcher still ran {hang:g} s after the crash; it exits "
        "(1, RendezvousConnectionError) only when the failed node hosted the rendezvous store "
        f"({hosted[True]} of {runs} runs); exit codes (None = killed at teardown) "
        f"{', '.join(sorted(codes_seen))}"
    )
    return [g_poll, *([g_wait] if not quick else []), t_first, t_all]
