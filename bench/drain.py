"""drain: from `gelastic nodes --drain` to the job re-formed on the other nodes, and the notice.

Three agents (LocalCluster lease 3 s, heartbeat 0.5 s) and a job of 2 workers per node with
min_nodes=2, max_nodes=3, max_restarts=0, last_call_timeout=0, of `_drain_worker.py`: all six
workers start and poll `client.preempted()` every 2 ms. 0.5 s after the last one started the
benchmark writes the drain time and drains the node holding group rank 1 (`drain_node`, the
RPC `gelastic nodes --drain` makes). The job re-forms on the two other nodes without spending
a restart; the new round's workers see the drain file, write their start time and exit 0, so
the job then succeeds. The node is undrained before the next run.

- `drain -> re-formed (leave on the notice)`: deadline 30 s, stop_grace 10 s (20 s of notice
  before SIGTERM). The workers exit 0 as soon as they see the notice, so the round is replaced
  at once: drain -> the last of the 4 new workers' first line.
- `drain -> every worker told`: in those runs, drain -> the last of the six workers of the
  round (on all three nodes) to see the notice.
- `drain -> re-formed (no deadline: SIGTERM at once)`: no deadline (each job's stop_grace),
  workers that exit on SIGTERM: the drain's stop is then a lost node's re-form with a graceful
  stop.
- `notice -> SIGTERM (deadline 2 s, stop_grace 1 s)`: workers that stay until SIGTERM: the
  agents send it deadline - grace = 1 s after the notice, the coordinator's timeline. Per run,
  the median over the six workers of (SIGTERM received - notice seen).

torchrun has no drain; the nearest is SIGTERM to one launcher (what a pod eviction sends):
`SIGTERM to a launcher -> restarted (non-host launcher)`, three launchers `--nnodes 2:3
--max-restarts 1` of `_worker.py` in mode `hold`. The launcher stops its workers and exits;
the survivors are never told (a completed round does not watch its members), so nothing is
re-formed: this times out after 10 s (3 s with --quick).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path

from bench._common import (
    GELASTIC,
    PY,
    TORCH,
    Measurement,
    RunDirs,
    TorchrunGroup,
    gelastic_cluster,
    log,
    poll_result,
    wait_starts,
    worker_env,
    write_event,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "drain"
DRAIN_WORKER = str(Path(__file__).resolve().parent / "_drain_worker.py")
TIMEOUT = 60.0
HANG_TIMEOUT = 10.0
QUICK_HANG_TIMEOUT = 3.0
NODES, NPROC = 3, 2
SETTLE = 0.5


def _stamps(run_dir: Path, kind: str) -> dict[str, dict[str, float]]:
    """pid -> the stamp of that kind the worker wrote."""
    return {
        p.stem.split("-", 1)[1]: json.loads(p.read_text()) for p in run_dir.glob(f"{kind}-*.json")
    }


def _gelastic_run(
    cluster: LocalCluster,
    run_dir: Path,
    *,
    mode: str,
    deadline: float | None,
    stop_grace: float,
) -> tuple[float, float, float | None]:
    """(drain -> re-formed, drain -> every worker told, median notice -> SIGTERM or None)."""
    spec = JobSpec(
        entrypoint=[PY, DRAIN_WORKER],
        nproc_per_node=NPROC,
        min_nodes=2,
        max_nodes=NODES,
        max_restarts=0,
        last_call_timeout=0,
        stop_grace=stop_grace,
        env=worker_env(run_dir, mode),
        name="bench-drain",
    )
    job = cluster.client.submit(spec)
    first = wait_starts(run_dir, NODES * NPROC, TIMEOUT, alive=lambda: job.poll() is None)
    if first is None:
        job.cancel()
        raise RuntimeError("the first round's workers did not all start")
    victim = next(m.node for m in job.status().members if m.group_rank == 1)
    time.sleep(SETTLE)
    t_drain = write_event(run_dir)
    cluster.client.drain_node(victim, deadline, "bench")
    try:
        later = wait_starts(
            run_dir, (NODES - 1) * NPROC, TIMEOUT, later=True, alive=lambda: job.poll() is None
        )
        result, _ = poll_result(job, TIMEOUT)
    finally:
        cluster.client.undrain_node(victim)
    if later is None or result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"no re-form: {result.state} {result.reason}")
    if [a.attempt for a in result.attempts] != [0, 0]:
        ended = "; ".join(f"attempt {a.attempt}: {a.end_reason}" for a in result.attempts)
        raise RuntimeError(f"not one re-form and the end, without a restart: {ended}")
    notices = _stamps(run_dir, "notice")
    terms = _stamps(run_dir, "term")
    # A worker told: it saw the notice, or (SIGTERM at once) the notice was there at SIGTERM.
    seen = set(notices) | {pid for pid, t in terms.items() if t["had_notice"]}
    if len(seen) != NODES * NPROC or any(not t["had_notice"] for t in terms.values()):
        raise RuntimeError(f"{len(seen)} of {NODES * NPROC} workers had the notice before SIGTERM")
    # When each worker saw it (its SIGTERM handler may have cut the write of its stamp short).
    times = {pid: n["t"] for pid, n in notices.items()}
    times.update({pid: t["notice"] for pid, t in terms.items() if t["notice"] is not None})
    told = max(times.values()) - t_drain if len(times) == NODES * NPROC else float("nan")
    gaps = [t["t"] - t["notice"] for t in terms.values() if t["notice"] is not None]
    return max(s.t for s in later) - t_drain, told, statistics.median(gaps) if gaps else None


def _torchrun_run(run_dir: Path, hang: float) -> tuple[float | None, list[int | None]]:
    """SIGTERM to a non-host launcher: (-> survivors' workers restarted, exit codes)."""
    with TorchrunGroup(
        count=NODES,
        nnodes=f"2:{NODES}",
        nproc_per_node=NPROC,
        max_restarts=1,
        env=worker_env(run_dir, "hold"),
        log_dir=run_dir,
    ) as group:
        group.start()
        if (
            wait_starts(run_dir, NODES * NPROC, TIMEOUT, alive=lambda: bool(group.running()))
            is None
        ):
            raise RuntimeError(f"torchrun's workers did not all start: {group.returncodes()}")
        host = group.store_host()
        if host is None:
            raise RuntimeError("no torchrun launcher listens on the rendezvous port")
        victim = next(i for i in range(NODES) if i != host)
        time.sleep(SETTLE)
        t_term = write_event(run_dir)
        os.kill(group.procs[victim].pid, signal.SIGTERM)
        later = wait_starts(
            run_dir, (NODES - 1) * NPROC, hang, later=True, alive=lambda: bool(group.running())
        )
        value = max(s.t for s in later) - t_term if later is not None else None
        codes = group.returncodes()
    return value, codes


def run(runs: int, quick: bool) -> list[Measurement]:
    leave = Measurement(SCENARIO, "drain -> re-formed (leave on the notice)", GELASTIC)
    told = Measurement(SCENARIO, "drain -> every worker told", GELASTIC)
    at_once = Measurement(SCENARIO, "drain -> re-formed (no deadline: SIGTERM at once)", GELASTIC)
    term = Measurement(SCENARIO, "notice -> SIGTERM (deadline 2 s, stop_grace 1 s)", GELASTIC)
    t_restart = Measurement(SCENARIO, "SIGTERM to a launcher -> restarted (non-host)", TORCH)
    hang = QUICK_HANG_TIMEOUT if quick else HANG_TIMEOUT
    codes_seen: set[str] = set()
    with RunDirs(SCENARIO) as dirs, gelastic_cluster(nodes=NODES) as cluster:
        for i in range(runs):
            r, t, _ = _gelastic_run(
                cluster, dirs.new("leave"), mode="leave", deadline=30.0, stop_grace=10.0
            )
            leave.add(r)
            told.add(t)
            log(f"  {SCENARIO} run {i + 1}/{runs} leave: re-formed {r:.3f} s, told {t:.3f} s")
            r, _, _ = _gelastic_run(
                cluster, dirs.new("term"), mode="stay", deadline=None, stop_grace=10.0
            )
            at_once.add(r)
            log(f"  {SCENARIO} run {i + 1}/{runs} no deadline: re-formed {r:.3f} s")
            _, _, gap = _gelastic_run(
                cluster, dirs.new("timeline"), mode="stay", deadline=2.0, stop_grace=1.0
            )
            term.add(gap)
            shown = f"{gap:.3f} s" if gap is not None else "no SIGTERM seen"
            log(f"  {SCENARIO} run {i + 1}/{runs} deadline 2 s: notice -> SIGTERM {shown}")
            tr, codes = _torchrun_run(dirs.new("t"), hang)
            t_restart.add(tr)
            codes_seen.add(str(codes))
            shown = f"{tr:.3f} s" if tr is not None else f"not within {hang:g} s"
            log(f"  {SCENARIO} run {i + 1}/{runs} torchrun SIGTERM: restarted {shown}, {codes}")
    term.note = "the coordinator's timeline says 1.0 s (deadline 2 s - grace 1 s)"
    t_restart.note = (
        f"timed out = the survivors' workers not restarted within {hang:g} s; launchers' exit "
        f"codes then: {', '.join(sorted(codes_seen))}"
    )
    return [leave, told, at_once, term, t_restart]
