"""torch_recovery: from a torch rank crashing to every rank of the next attempt training again.

A job with max_restarts=1 of `_torch_worker.py` in mode `crash`: every rank runs
init_process_group(gloo) + one all_reduce; once all are past it (plus 0.5 s), rank 1 writes the
crash time and exits 1 (`os._exit`); the others sleep as if training. The workers of attempt 1
see the crash file, run init + all_reduce again, stamp `ready` and exit 0, so the job succeeds.
Sizes 2x2 and 2x4 (`--quick`: 2x2), a LocalCluster of exactly the job's nodes per size.

- `NxM crash -> training again`: the crash stamp -> the last attempt-1 rank past init +
  all_reduce. It includes noticing the exit, stopping the other ranks, the new round, starting
  the processes, `import torch` and gloo's rendezvous.
- `NxM crash -> restarted`: the crash -> the last attempt-1 rank's first line.
- `NxM (preload) crash -> training again` (gelastic): the same spec with `preload=("torch",)`;
  "n/a: preload not available" when JobSpec has no `preload` field.
- `2x2 (SIGTERM checkpoint) crash -> training again`, both systems, and `(preload, SIGTERM
  checkpoint)` for gelastic: the surviving ranks save a checkpoint of `TERM_CKPT_MIB` MiB in a
  SIGTERM handler (`$BENCH_TERM_CKPT`, see `_torch_worker.py`) before they exit, as a
  preemption-aware script does; every survivor's `ckpt` stamp must be there, so the stop gave the
  handler its time. The recovery then includes that save.

torchrun runs the same script with `--max-restarts 1` on one launcher per node, with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it attempt 1's init_process_group fails here, see
TORCHRUN_RESTART_ENV); its measurements stop at the same worker-side stamps.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench._common import (
    GELASTIC,
    PRELOAD_NA,
    PY,
    TORCH,
    TORCH_ENV,
    TORCH_WORKER,
    Measurement,
    RunDirs,
    gelastic_cluster,
    log,
    poll_result,
    preload_spec,
    read_event,
    read_phase,
    size_runs,
    torch_torchrun_group,
    wait_phase,
    worker_env,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "torch_recovery"
TIMEOUT = 120.0
TERM_CKPT_MIB = "16"
"""The state a survivor saves in its SIGTERM handler, in MiB (`$BENCH_TERM_CKPT`)."""
TORCHRUN_RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Without it torchrun's workers share the rendezvous TCPStore across restarts, keyed by a
restart count each launcher keeps for itself: the node whose worker did not fail keeps 0, its
ranks read attempt 0's gloo addresses and init_process_group fails (pytorch/pytorch#135712)."""


def _spec(run_dir: Path, nodes: int, nproc: int, *, term_ckpt: bool = False) -> JobSpec:
    extra = {"BENCH_TERM_CKPT": TERM_CKPT_MIB} if term_ckpt else {}
    return JobSpec(
        entrypoint=[PY, TORCH_WORKER],
        nproc_per_node=nproc,
        min_nodes=nodes,
        max_nodes=nodes,
        max_restarts=1,
        last_call_timeout=0,
        env=worker_env(run_dir, "crash", BENCH_CRASH_RANK="1", **TORCH_ENV, **extra),
        name=f"bench-torch-crash-{nodes}x{nproc}",
    )


def _times(run_dir: Path, count: int, *, term_ckpt: bool = False) -> tuple[float, float]:
    """(crash -> training again, crash -> restarted) from the stamps of a finished run; with
    `term_ckpt`, every survivor of the crash must have stamped its SIGTERM checkpoint."""
    if term_ckpt:
        saved = len([s for s in read_phase(run_dir, "ckpt") if not s.later])
        if saved != count - 1:
            raise RuntimeError(f"{saved} of {count - 1} survivors saved their SIGTERM checkpoint")
    crash = read_event(run_dir)
    ready = [s for s in read_phase(run_dir, "ready") if s.later]
    starts = [s for s in read_phase(run_dir, "start") if s.later]
    if crash is None or len(ready) != count or len(starts) != count:
        raise RuntimeError(
            f"crash stamp {crash}, {len(starts)} attempt-1 starts, {len(ready)} attempt-1 ready"
        )
    return max(s.t for s in ready) - crash, max(s.t for s in starts) - crash


def _gelastic_run(
    cluster: LocalCluster, spec: JobSpec, run_dir: Path, count: int, *, term_ckpt: bool = False
) -> tuple[float, float]:
    job = cluster.client.submit(spec)
    result, _ = poll_result(job, TIMEOUT)
    if result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"the restarted job did not succeed:\n{result.format_failures()}")
    if [a.attempt for a in result.attempts] != [0, 1]:
        raise RuntimeError(f"expected attempts 0 and 1, got {result.attempts}")
    return _times(run_dir, count, term_ckpt=term_ckpt)


def _torchrun_run(
    run_dir: Path, nodes: int, nproc: int, *, term_ckpt: bool = False
) -> tuple[tuple[float, float] | None, list[int | None]]:
    extra = {"BENCH_TERM_CKPT": TERM_CKPT_MIB} if term_ckpt else {}
    with torch_torchrun_group(
        count=nodes,
        nnodes=str(nodes),
        nproc_per_node=nproc,
        max_restarts=1,
        env=worker_env(
            run_dir, "crash", BENCH_CRASH_RANK="1", **TORCH_ENV, **TORCHRUN_RESTART_ENV, **extra
        ),
        log_dir=run_dir,
    ) as group:
        group.start()
        ready = wait_phase(
            run_dir,
            "ready",
            nodes * nproc,
            TIMEOUT,
            later=True,
            alive=lambda: bool(group.running()),
        )
        group.wait(TIMEOUT)
        codes = group.returncodes()
    if ready is None:
        return None, codes
    return _times(run_dir, nodes * nproc, term_ckpt=term_ckpt), codes


def run(runs: int, quick: bool) -> list[Measurement]:
    sizes = [(2, 2)] if quick else [(2, 2), (2, 4)]
    out: list[Measurement] = []
    with RunDirs(SCENARIO) as dirs:
        for nodes, nproc in sizes:
            out += _size(dirs, runs, nodes, nproc, term_rows=(nodes, nproc) == (2, 2))
    return out


def _size(
    dirs: RunDirs, runs: int, nodes: int, nproc: int, *, term_rows: bool
) -> list[Measurement]:
    """One size's rows; with `term_rows` also the SIGTERM checkpoint rows."""
    size = f"{nodes}x{nproc}"
    count = nodes * nproc
    g_again = Measurement(SCENARIO, f"{size} crash -> training again", GELASTIC)
    g_restart = Measurement(SCENARIO, f"{size} crash -> restarted", GELASTIC)
    t_again = Measurement(SCENARIO, f"{size} crash -> training again", TORCH)
    t_restart = Measurement(SCENARIO, f"{size} crash -> restarted", TORCH)
    p_again = Measurement(SCENARIO, f"{size} (preload) crash -> training again", GELASTIC)
    term = f"{size} (SIGTERM checkpoint) crash -> training again"
    g_term = Measurement(SCENARIO, term, GELASTIC)
    t_term = Measurement(SCENARIO, term, TORCH)
    p_term = Measurement(
        SCENARIO, f"{size} (preload, SIGTERM checkpoint) crash -> training again", GELASTIC
    )
    preload = preload_spec(_spec(dirs.root, nodes, nproc)) is not None
    codes_seen: set[str] = set()
    with gelastic_cluster(nodes=nodes, slots=nproc) as cluster:
        n_runs = size_runs(runs, nodes * nproc)
        for i in range(n_runs):
            d = dirs.new(f"g{size}")
            again, restart = _gelastic_run(cluster, _spec(d, nodes, nproc), d, count)
            g_again.add(again)
            g_restart.add(restart)
            msg = f"training again {again:.3f} s, restarted {restart:.3f} s"
            if preload:
                d = dirs.new(f"p{size}")
                spec = preload_spec(_spec(d, nodes, nproc))
                assert spec is not None
                pa, _ = _gelastic_run(cluster, spec, d, count)
                p_again.add(pa)
                msg += f"; preload training again {pa:.3f} s"
            if term_rows:
                d = dirs.new(f"gt{size}")
                ga, _ = _gelastic_run(
                    cluster, _spec(d, nodes, nproc, term_ckpt=True), d, count, term_ckpt=True
                )
                g_term.add(ga)
                msg += f"; SIGTERM checkpoint {ga:.3f} s"
                if preload:
                    d = dirs.new(f"pt{size}")
                    spec = preload_spec(_spec(d, nodes, nproc, term_ckpt=True))
                    assert spec is not None
                    pa, _ = _gelastic_run(cluster, spec, d, count, term_ckpt=True)
                    p_term.add(pa)
                    msg += f"; preload SIGTERM checkpoint {pa:.3f} s"
            log(f"  {SCENARIO} run {i + 1}/{n_runs} gelastic {size}: {msg}")
            time.sleep(0.2)
            for checkpoint, again_m, restart_m in (
                (False, t_again, t_restart),
                *([(True, t_term, None)] if term_rows else []),
            ):
                times, codes = _torchrun_run(
                    dirs.new(f"t{size}"), nodes, nproc, term_ckpt=checkpoint
                )
                codes_seen.add(str(codes))
                again_m.add(None if times is None else times[0])
                if restart_m is not None:
                    restart_m.add(None if times is None else times[1])
                shown = (
                    "timed out"
                    if times is None
                    else (f"training again {times[0]:.3f} s, restarted {times[1]:.3f} s")
                )
                what = " (SIGTERM checkpoint)" if checkpoint else ""
                log(
                    f"  {SCENARIO} run {i + 1}/{n_runs} torchrun {size}{what}: {shown}, "
                    f"exit codes {codes}"
                )
    t_again.note = f"launcher exit codes {', '.join(sorted(codes_seen))}"
    for row, base in ((p_again, t_again), (p_term, t_term)):
        if not preload:
            row.note = PRELOAD_NA
        elif row.median and base.median is not None:
            row.note = f"torchrun / this: {base.median / row.median:.1f}x"
    rows = [g_again, t_again, g_restart, t_restart, p_again]
    return rows + ([g_term, t_term, p_term] if term_rows else [])
