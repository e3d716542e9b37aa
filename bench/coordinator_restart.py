"""coordinator_restart: from starting a coordinator again after `kill -9` to the job recovered.

A job runs on every node; 1 s after all its workers run (so the coordinator's batched state
write has happened; see the note on the race below) the benchmark SIGKILLs the coordinator,
optionally waits (`down`), and starts it again on the same port with the same `--state-dir`.
The clock starts right before that second `coordinator serve` is spawned, and stops when the
job is recovered, which the benchmark checks by polling (every 20 ms, a fresh client) until
all of these hold:

- GetEvents has an `adopted` event since the restart for every member node (the agent
  reconnected and re-reported the round it runs in its Hello);
- GetJob: the job RUNNING in the same round, every worker HEALTHY with the pid it had before;
- ListNodes: all N nodes live.

The restored state alone already satisfies the last two: nodes come back `live` from disk
(with `reconnect_grace`, 15 s, to reconnect) and the workers HEALTHY with their old pids, so
only the `adopted` events tell a node that has reconnected from one that has not. The note
says whether that held for the first answer after the restart.

- `N agents: restart -> listening`: the spawn -> its port file appears (Python start, state
  load, bind; the file is looked for every 50 ms with real agents, 20 ms with simulated ones).
- `N agents: restart -> all adopted`: the spawn -> the coordinator's own timestamp of the last
  `adopted` event.
- `N agents: restart -> recovered`: the spawn -> the benchmark sees every condition above.
- `..., down 5 s`: the same with 5 s between the kill and the restart (not with --quick).

Sizes: 2 real agents (a LocalCluster, lease 3 s, heartbeat 0.5 s; a 2 x 1 job of
`python -c "import time; time.sleep(60)"`; the worker processes are checked to be the very same
afterwards) and 50 simulated agents (`_simnodes.py` with `resume`: they keep their round across
the restart and report it in Hello as the real agent does; a 50 x 1 job; lease 3 s, heartbeat
0.5 s). `--quick`: 2 real agents and 10 simulated ones, once each, down 0 s only.

Reconnect backoff dominates: both the agent and the simulated node pause a random time in
[0, d] between session attempts, d doubling from 0.05 s to 5 s (reset after a session of more
than 10 s). Every run uses a fresh cluster, so the session the kill ends is the first one
(d = 0.05 s), exactly as for an agent whose session lasted more than 10 s.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from bench._common import GELASTIC, Measurement, gelastic_cluster, log
from bench._simnodes import CoordinatorProcess, SimFleet, sim_job_spec, wait_round_started
from client import Client, GelasticError, JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, poll_until

SCENARIO = "coordinator_restart"
REAL_NODES = 2
SIM_NODES = 50
QUICK_SIM_NODES = 10
DOWNS = (0.0, 5.0)
QUICK_DOWNS = (0.0,)
SETTLE_S = 1.0
"""After every worker runs, before the kill: the coordinator writes its state in batches."""
POLL_S = 0.02
TIMEOUT = 60.0
"""A run whose job is not recovered by then counts as timed out (reconnect grace is 15 s)."""
LEASE, HEARTBEAT = 3.0, 0.5


@dataclass
class _Before:
    job_id: str
    round: int
    pids: dict[int, int]
    nodes: set[str]
    seq: int
    """The job's last event sequence number before the kill."""


@dataclass
class _Run:
    listening: float
    adopted: float | None
    recovered: float | None
    looked_recovered_early: bool
    """The first answer after the restart already showed all nodes live and every worker
    HEALTHY with its old pid, before every node was adopted."""
    detail: str = ""


def _snapshot(client: Client, job_id: str) -> _Before:
    st = client.job(job_id).status()
    if st.state != JobState.RUNNING or not all(
        w.state == WorkerState.HEALTHY and w.pid for w in st.workers
    ):
        raise RuntimeError(f"job {job_id} not running before the kill: {st.state} {st.reason}")
    events = client.events(job_id)
    return _Before(
        job_id=job_id,
        round=st.round,
        pids={w.global_rank: w.pid for w in st.workers},
        nodes={m.node for m in st.members},
        seq=max(e.seq for e in events),
    )


def _wait_recovered(
    address: str, before: _Before, t0: float, listening: float, token_file: str | None = None
) -> _Run:
    """Poll until the job is recovered (see the module docstring) or TIMEOUT passes."""
    adopted: dict[str, float] = {}
    first_answer: bool | None = None
    detail = ""
    deadline = time.monotonic() + TIMEOUT
    with Client(address, timeout=5.0, token_file=token_file) as client:
        while True:
            try:
                for e in client.events(before.job_id, before.seq):
                    if e.kind == "adopted" and e.node in before.nodes:
                        adopted.setdefault(e.node, e.timestamp)
                st = client.job(before.job_id).status()
                live = {n.name for n in client.list_nodes() if n.state == "live"}
            except GelasticError as exc:
                detail = f"last error: {exc}"
            else:
                same_round = st.state == JobState.RUNNING and st.round == before.round
                healthy = {
                    w.global_rank: w.pid for w in st.workers if w.state == WorkerState.HEALTHY
                } == before.pids
                nodes_live = before.nodes <= live
                all_adopted = set(adopted) == before.nodes
                if first_answer is None:
                    first_answer = same_round and healthy and nodes_live and not all_adopted
                if all_adopted and same_round and healthy and nodes_live:
                    return _Run(
                        listening=listening,
                        adopted=max(adopted.values()) - t0,
                        recovered=time.time() - t0,
                        looked_recovered_early=bool(first_answer),
                    )
                detail = (
                    f"{st.state.value} round {st.round} (was {before.round}), "
                    f"{len(adopted)}/{len(before.nodes)} adopted, "
                    f"{len(before.nodes & live)}/{len(before.nodes)} live, "
                    f"workers {'as before' if healthy else 'CHANGED'}: {st.reason}"
                )
            if time.monotonic() > deadline:
                log(f"  {SCENARIO}: not recovered after {TIMEOUT:g} s: {detail}")
                return _Run(listening, None, None, bool(first_answer), detail)
            time.sleep(POLL_S)


# ---- real agents ------------------------------------------------------------------------------


def _real_run(down: float) -> _Run:
    with gelastic_cluster(REAL_NODES, slots=1) as cluster:
        spec = JobSpec(
            entrypoint=[sys.executable, "-c", "import time; time.sleep(60)"],
            nproc_per_node=1,
            min_nodes=REAL_NODES,
            max_nodes=REAL_NODES,
            name="bench-coord-restart",
        )
        job = cluster.client.submit(spec)
        poll_until(
            lambda: _all_healthy(cluster, job.job_id, REAL_NODES),
            TIMEOUT,
            interval=POLL_S,
            what="every worker to run",
        )
        time.sleep(SETTLE_S)
        before = _snapshot(cluster.client, job.job_id)
        procs = {r: psutil.Process(pid) for r, pid in before.pids.items()}
        created = {r: p.create_time() for r, p in procs.items()}
        cluster.kill_coordinator()
        time.sleep(down)
        t0 = time.time()
        cluster.start_coordinator(port=cluster.port)
        listening = time.time() - t0
        run = _wait_recovered(cluster.address, before, t0, listening, cluster.token_file)
        if run.recovered is not None:
            # The very same processes: nothing was restarted behind the coordinator's back.
            for r, p in procs.items():
                if not p.is_running() or p.create_time() != created[r]:
                    raise RuntimeError(f"rank {r}'s worker (pid {p.pid}) did not survive")
        with cluster.connect(timeout=10.0) as c:
            c.cancel(job.job_id)
        return run


def _all_healthy(cluster: LocalCluster, job_id: str, n: int) -> bool:
    ws = cluster.client.job(job_id).status().workers
    return len([w for w in ws if w.pid and w.state == WorkerState.HEALTHY]) == n


# ---- simulated agents -------------------------------------------------------------------------


def _sim_run(n: int, down: float) -> tuple[_Run, int]:
    """The run and the session attempts the simulated nodes made in vain meanwhile."""
    coord = CoordinatorProcess(lease=LEASE, heartbeat_interval=HEARTBEAT)
    fleet: SimFleet | None = None
    try:
        coord.start()
        fleet = SimFleet(coord.address, n, processes=1, health=True, resume=True)
        fleet.start()
        fleet.wait_welcomed(30.0)
        with Client(coord.address, timeout=10.0) as client:
            job = client.submit(sim_job_spec(n, name="bench-coord-restart"))
            times = wait_round_started(fleet, client, job.job_id, 30.0)
            if times.all_started is None:
                raise RuntimeError(f"the job did not start on {n} simulated nodes")
            poll_until(
                _job_healthy(client, job.job_id, n), 30.0, interval=POLL_S, what="the job to run"
            )
            time.sleep(SETTLE_S)
            before = _snapshot(client, job.job_id)
        refused = fleet.stats().refused
        coord.kill()
        time.sleep(down)
        t0 = time.time()
        coord.start()
        listening = time.time() - t0
        run = _wait_recovered(coord.address, before, t0, listening)
        after = fleet.stats()
        return run, after.refused - refused
    finally:
        # The coordinator first: simulated nodes leaving first would make it process N losses.
        coord.stop(grace=5.0)
        if fleet is not None:
            fleet.stop()


def _job_healthy(client: Client, job_id: str, n: int) -> Callable[[], bool]:
    def check() -> bool:
        st = client.job(job_id).status()
        healthy = [w for w in st.workers if w.pid and w.state == WorkerState.HEALTHY]
        return st.state == JobState.RUNNING and len(healthy) == n

    return check


# ---- the scenario -----------------------------------------------------------------------------


def run(runs: int, quick: bool) -> list[Measurement]:
    downs = QUICK_DOWNS if quick else DOWNS
    sim_n = QUICK_SIM_NODES if quick else SIM_NODES
    out: list[Measurement] = []
    for label, one_run in (
        (f"{REAL_NODES} agents", lambda d: (_real_run(d), None)),
        (f"{sim_n} simulated agents", lambda d: _sim_run(sim_n, d)),
    ):
        for down in downs:
            suffix = f", down {down:g} s" if down else ""
            listening = Measurement(SCENARIO, f"{label}{suffix}: restart -> listening", GELASTIC)
            adopted = Measurement(SCENARIO, f"{label}{suffix}: restart -> all adopted", GELASTIC)
            recovered = Measurement(SCENARIO, f"{label}{suffix}: restart -> recovered", GELASTIC)
            early = 0
            vain: list[int] = []
            failures: list[str] = []
            for i in range(runs):
                r, refused = one_run(down)
                listening.add(r.listening)
                adopted.add(r.adopted)
                recovered.add(r.recovered)
                early += r.looked_recovered_early
                if refused is not None:
                    vain.append(refused)
                if r.recovered is None:
                    failures.append(f"run {i + 1}: {r.detail}")
                log(
                    f"  {SCENARIO} {label}{suffix} run {i + 1}/{runs}: listening "
                    f"{r.listening:.3f} s, all adopted "
                    + ("-" if r.adopted is None else f"{r.adopted:.3f} s")
                    + ", recovered "
                    + ("timed out" if r.recovered is None else f"{r.recovered:.3f} s")
                    + ("" if refused is None else f" ({refused} session attempts in vain)")
                )
            notes = [
                "reconnect pause random in [0, d], d = 0.05 s doubling to 5 s"
                + (" (simulated nodes: the agent's schedule)" if vain else " (nodeagent)"),
                f"{early}/{runs} runs: the first answer after the restart already showed every "
                "node live and every worker HEALTHY with its old pid, before all were adopted",
            ]
            if vain:
                notes.append(
                    f"failed session attempts per run (all nodes): median "
                    f"{statistics.median(vain):g}"
                )
            recovered.note = "; ".join(notes + failures)
            out += [listening, adopted, recovered]
    return out
