"""recovery_agent_kill: from SIGKILLing one node's agent to the survivors' workers running again.

Three agents (LocalCluster lease 3 s, heartbeat 0.5 s) and a job of 2 workers per node with
min_nodes=2, max_nodes=3, max_restarts=0, of `_worker.py` in mode `hold`: all six workers
start and sleep. 0.5 s after the last one started, the benchmark writes the kill time and
SIGKILLs the agent holding group rank 1 (`LocalCluster.kill_agent`); its workers die with it
(PR_SET_PDEATHSIG). The job re-forms on the two survivors without spending a restart; their
new workers see the kill file, write their start time and exit 0, so the job then succeeds.

- `kill -> restarted (last_call 0 s)`: the kill -> the last of the 4 new workers' first line.
  With `last_call_timeout=0` the re-formed round closes as soon as min_nodes=2 are free (with
  2 free nodes and max_nodes=3 a round otherwise waits the whole last call), so this is
  detection + stopping the survivors' workers + rendezvous + start.
- `kill -> restarted (last_call 1 s)`: the same with `last_call_timeout=1`; it includes that
  second of waiting for a third node.
- `kill -> node lost`: the kill -> the coordinator's `node_lost` event (its own timestamp,
  same host clock). A SIGKILLed agent's stream ends at once, so the lease is not what
  detects it.

After each run the killed agent is started again under the same name.

torchrun: three launchers, `--nnodes 2:3 --max-restarts 1`, SIGKILL one launcher:

- `kill -> restarted (non-host launcher)`: SIGKILL a launcher that does not host the c10d
  store. The survivors are never told (a completed round does not watch its members), and
  the killed launcher's workers live on (their own sessions), so nothing fails: this times
  out after 10 s (3 s with --quick).
- `store host killed -> survivors exited`: killing the launcher that hosts the c10d store
  makes every survivor exit 1 (RendezvousConnectionError): the job is lost, not recovered.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil

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
    wait_starts,
    worker_env,
    write_event,
)
from client import JobSpec, WorkerState
from gelastic.local import LocalCluster

SCENARIO = "recovery_agent_kill"
TIMEOUT = 60.0
HANG_TIMEOUT = 10.0
QUICK_HANG_TIMEOUT = 3.0
NODES, NPROC = 3, 2
SETTLE = 0.5


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _gelastic_run(
    cluster: LocalCluster, run_dir: Path, last_call: float
) -> tuple[float, float, int]:
    """(kill -> restarted, kill -> node lost, orphaned workers of the killed agent)."""
    spec = JobSpec(
        entrypoint=[PY, WORKER],
        nproc_per_node=NPROC,
        min_nodes=2,
        max_nodes=NODES,
        max_restarts=0,
        last_call_timeout=last_call,
        env=worker_env(run_dir, "hold"),
        name="bench-agent-kill",
    )
    job = cluster.client.submit(spec)
    first = wait_starts(run_dir, NODES * NPROC, TIMEOUT, alive=lambda: job.poll() is None)
    if first is None:
        job.cancel()
        raise RuntimeError("the first attempt's workers did not all start")
    victim = next(m.node for m in job.status().members if m.group_rank == 1)
    agent = cluster.agents[victim]
    workers = [c.pid for c in psutil.Process(agent.popen.pid).children(recursive=True)]
    time.sleep(SETTLE)
    t_kill = write_event(run_dir)
    cluster.kill_agent(victim)
    agent.log.close()
    later = wait_starts(
        run_dir, (NODES - 1) * NPROC, TIMEOUT, later=True, alive=lambda: job.poll() is None
    )
    orphans = len(_alive(workers))
    result, _ = poll_result(job, TIMEOUT)
    if later is None or result.state != WorkerState.SUCCEEDED:
        raise RuntimeError(f"no recovery: {result.state} {result.reason}")
    lost = [e.timestamp for e in job.events() if e.kind == "node_lost" and e.node == victim]
    if not lost:
        raise RuntimeError("no node_lost event")
    cluster.start_agent(victim)
    return max(s.t for s in later) - t_kill, lost[0] - t_kill, orphans


def _torchrun_run(
    run_dir: Path, kill_host: bool, hang: float
) -> tuple[float | None, int, list[int | None]]:
    """Non-host: (kill -> survivors' workers restarted, orphans, codes); host: survivors exited."""
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
        victim = host if kill_host else next(i for i in range(NODES) if i != host)
        workers = [c.pid for c in psutil.Process(group.procs[victim].pid).children(recursive=True)]
        time.sleep(SETTLE)
        t_kill = write_event(run_dir)
        group.kill(victim)
        survivors = [i for i in range(NODES) if i != victim]
        value: float | None = None
        if kill_host:
            if group.wait(hang):
                value = max(group.exit_times[i] for i in survivors) - t_kill
        else:
            later = wait_starts(
                run_dir, (NODES - 1) * NPROC, hang, later=True,
                alive=lambda: bool(group.running()),
            )  # fmt: skip
            if later is not None:
                value = max(s.t for s in later) - t_kill
        orphans = len(_alive(workers))
        codes = group.returncodes()
    return value, orphans, codes


def run(runs: int, quick: bool) -> list[Measurement]:
    last_calls = [0.0] if quick else [0.0, 1.0]
    g_restart = {
        lc: Measurement(SCENARIO, f"kill -> restarted (last_call {lc:g} s)", GELASTIC)
        for lc in last_calls
    }
    g_lost = Measurement(SCENARIO, "kill -> node lost", GELASTIC)
    t_restart = Measurement(SCENARIO, "kill -> restarted (non-host launcher)", TORCH)
    t_host = Measurement(SCENARIO, "store host killed -> survivors exited", TORCH)
    orphans = {GELASTIC: 0, TORCH: 0}
    host_codes: set[str] = set()
    hang = QUICK_HANG_TIMEOUT if quick else HANG_TIMEOUT
    with RunDirs(SCENARIO) as dirs, gelastic_cluster(nodes=NODES) as cluster:
        for i in range(runs):
            for lc in last_calls:
                r, lost, orph = _gelastic_run(cluster, dirs.new(f"g{lc:g}"), lc)
                g_restart[lc].add(r)
                g_lost.add(lost)
                orphans[GELASTIC] += orph
                log(
                    f"  {SCENARIO} run {i + 1}/{runs} gelastic last_call {lc:g} s: restarted "
                    f"{r:.3f} s, node lost {lost:.3f} s, orphaned workers {orph}"
                )
            tr, orph, codes = _torchrun_run(dirs.new("t"), kill_host=False, hang=hang)
            t_restart.add(tr)
            orphans[TORCH] += orph
            shown = f"{tr:.3f} s" if tr is not None else f"not within {hang:g} s"
            log(
                f"  {SCENARIO} run {i + 1}/{runs} torchrun: restarted {shown}, orphaned workers "
                f"{orph}, exit codes {codes}"
            )
            if not quick:
                th, _, codes = _torchrun_run(dirs.new("th"), kill_host=True, hang=hang)
                t_host.add(th)
                host_codes.add(str(codes))
                shown = f"{th:.3f} s" if th is not None else f"not within {hang:g} s"
                log(
                    f"  {SCENARIO} run {i + 1}/{runs} torchrun store host killed: "
                    f"survivors exited {shown}, codes {codes}"
                )
    g_lost.note = f"killed agents' workers still alive after recovery: {orphans[GELASTIC]}"
    t_restart.note = (
        f"timed out = survivors' workers not restarted within {hang:g} s; the killed "
        "launcher's workers still alive after that wait: "
        f"{orphans[TORCH]} (over all runs)"
    )
    t_host.note = f"survivors exit, the job is lost (codes {', '.join(sorted(host_codes))})"
    out = [*g_restart.values(), g_lost, t_restart]
    if not quick:
        out.append(t_host)
    return out
