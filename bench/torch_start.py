"""torch_start: from submitting a job to every rank past init_process_group(gloo) + one all_reduce.

The workers are `_torch_worker.py` in mode `ready`: they stamp their first line, `import torch`,
`init_process_group("gloo")` + one all_reduce (the stamp that counts), then exit 0. Sizes 2x2,
4x1 and 2x4 (`--quick`: 2x2). A LocalCluster of exactly the job's nodes and slots per size, so
every job of a size lands on the same nodes; the clock starts right before `submit()`:

- `NxM submit -> all past init+all_reduce`: the last rank's `ready` stamp.
- `NxM submit -> all torch imported`, `NxM submit -> all started`: the last rank's `torch` and
  `start` stamps, to tell interpreter start, torch import and gloo's rendezvous apart.
- `NxM (preload, warm) submit -> all past init+all_reduce` (gelastic): the spec with
  `preload=("torch",)` and `standby_linger` (each job's standbys wait for the next), after an untimed job of the very same spec (same env: one BENCH_DIR,
  emptied between runs) on the same nodes, so its standby workers are warm. "n/a: preload not available" when JobSpec has no `preload` field.

torchrun runs the same script: one launcher per node with a c10d rendezvous, the clock starting
right before the first is launched (torchrun has no standing agents).
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
    read_phase,
    size_runs,
    torch_torchrun_group,
    worker_env,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "torch_start"
TIMEOUT = 120.0
WARM_LINGER_S = 300.0
"""How long a warm job's standbys wait for the next: longer than the cold and torchrun runs between two warm ones."""
PHASES = (
    ("ready", "all past init+all_reduce"),
    ("torch", "all torch imported"),
    ("start", "all started"),
)


def _spec(run_dir: Path, nodes: int, nproc: int) -> JobSpec:
    return JobSpec(
        entrypoint=[PY, TORCH_WORKER],
        nproc_per_node=nproc,
        min_nodes=nodes,
        max_nodes=nodes,
        last_call_timeout=0,
        env=worker_env(run_dir, "ready", **TORCH_ENV),
        name=f"bench-torch-start-{nodes}x{nproc}",
    )


def _times(run_dir: Path, t0: float, count: int) -> dict[str, float]:
    out = {}
    for phase, _ in PHASES:
        stamps = read_phase(run_dir, phase)
        if len(stamps) != count:
            raise RuntimeError(f"expected {count} {phase!r} stamps, found {len(stamps)}")
        out[phase] = max(s.t for s in stamps) - t0
    return out


def _gelastic_run(
    cluster: LocalCluster, spec: JobSpec, run_dir: Path, count: int
) -> dict[str, float]:
    t0 = time.time()
    job = cluster.client.submit(spec)
    result, _ = poll_result(job, TIMEOUT)
    if result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"torch start job failed:\n{result.format_failures()}")
    return _times(run_dir, t0, count)


def _torchrun_run(run_dir: Path, nodes: int, nproc: int) -> dict[str, float]:
    with torch_torchrun_group(
        count=nodes,
        nnodes=str(nodes),
        nproc_per_node=nproc,
        max_restarts=0,
        env=worker_env(run_dir, "ready", **TORCH_ENV),
        log_dir=run_dir,
    ) as group:
        t0 = group.start()
        if not group.wait(TIMEOUT):
            raise TimeoutError(f"torchrun did not finish within {TIMEOUT:g} s")
        if any(rc != 0 for rc in group.returncodes()):
            raise RuntimeError(f"torchrun failed: return codes {group.returncodes()}")
    return _times(run_dir, t0, nodes * nproc)


def _clear(run_dir: Path) -> None:
    """Remove a finished run's stamps so the same directory (and spec) serves the next run."""
    for p in run_dir.glob("*.json"):
        p.unlink()


def _fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{phase} {times[phase]:.3f} s" for phase, _ in PHASES)


def run(runs: int, quick: bool) -> list[Measurement]:
    sizes = [(2, 2)] if quick else [(2, 2), (4, 1), (2, 4)]
    out: list[Measurement] = []
    with RunDirs(SCENARIO) as dirs:
        for nodes, nproc in sizes:
            size = f"{nodes}x{nproc}"
            g = {
                p: Measurement(SCENARIO, f"{size} submit -> {what}", GELASTIC) for p, what in PHASES
            }
            t = {p: Measurement(SCENARIO, f"{size} submit -> {what}", TORCH) for p, what in PHASES}
            pre = Measurement(
                SCENARIO, f"{size} (preload, warm) submit -> all past init+all_reduce", GELASTIC
            )
            with gelastic_cluster(nodes=nodes, slots=nproc) as cluster:
                warm_dir = dirs.new(f"warm{size}")
                # Standbys left by each job of the spec serve the next (a sweep).
                warm = preload_spec(_spec(warm_dir, nodes, nproc), linger=WARM_LINGER_S)
                if warm is not None:
                    # The first job of the spec starts the standbys the timed ones find warm.
                    _gelastic_run(cluster, warm, warm_dir, nodes * nproc)
                if not quick:
                    # One untimed job each, so no run pays for a cold page cache.
                    d = dirs.new(f"warmup{size}")
                    _gelastic_run(cluster, _spec(d, nodes, nproc), d, nodes * nproc)
                    _torchrun_run(dirs.new(f"warmup-t{size}"), nodes, nproc)
                n_runs = size_runs(runs, nodes * nproc)
                for i in range(n_runs):
                    d = dirs.new(f"g{size}")
                    times = _gelastic_run(cluster, _spec(d, nodes, nproc), d, nodes * nproc)
                    for p, m in g.items():
                        m.add(times[p])
                    msg = f"  {SCENARIO} run {i + 1}/{n_runs} gelastic {size}: {_fmt(times)}"
                    if warm is not None:
                        # The very same spec as the warm-up job (its BENCH_DIR emptied), so
                        # nothing but the job itself tells it apart from the one before.
                        _clear(warm_dir)
                        ptimes = _gelastic_run(cluster, warm, warm_dir, nodes * nproc)
                        pre.add(ptimes["ready"])
                        msg += f"; preload ready {ptimes['ready']:.3f} s"
                    log(msg)
                    times = _torchrun_run(dirs.new(f"t{size}"), nodes, nproc)
                    for p, m in t.items():
                        m.add(times[p])
                    log(f"  {SCENARIO} run {i + 1}/{n_runs} torchrun {size}: {_fmt(times)}")
            if warm is None:
                pre.note = PRELOAD_NA
            elif pre.median and t["ready"].median is not None:
                pre.note = f"torchrun / this: {t['ready'].median / pre.median:.1f}x"
            for p, _ in PHASES:
                out += [g[p], t[p]]
            out.append(pre)
    return out
