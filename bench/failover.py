"""failover: three coordinator replicas on one etcd; the leader is SIGKILLed.

Three `coordinator serve --store etcd://... --leader-ttl 3` on this host share a fresh
single-member etcd (`bench/_etcd.py`); the first one started leads. The agents are given the
three addresses (`--coordinator a,b,c`). Job A runs on every node (1 worker per node, every
slot taken); job B, of the same size, waits in the queue behind it. 1 s after A runs (the
leader's batched writes are done) the benchmark writes down the time, SIGKILLs the leader, and
lets A's workers finish (they exit 0 while no coordinator leads; the agents report the exits
when they are adopted). It then polls the two survivors (a GetJob on each, every 20 ms)
and, once one answers, that leader's events (every 0.25 s: their timestamps are the leader's).

- `N agents: kill -> new leader serving`: the kill -> the first call the new leader answered:
  the benchmark's GetJob, or an agent's session (its `adopted` event, the leader's timestamp),
  whichever came first.
- `N agents: kill -> a client answered`: the kill -> the first answer to the benchmark's GetJob
  (with 1,000 agents it waits behind the sessions the new leader took up as it started serving).
- `N agents: kill -> all adopted`: the kill -> the new leader's timestamp of the last
  `adopted` event of job A (every node reconnected, was redirected and re-reported its round).
- `N agents: kill -> queued job started`: the kill -> the new leader's timestamp of the last
  `workers_started` event of job B (A ended with the exits the agents carried over, and B's
  round started on every node).

Sizes: 2 real agents (`nodeagent`, 1 slot each; A's workers are Python processes that exit 0
once the benchmark opens a gate file; B's run `/bin/true`) and 1,000 simulated nodes
(`_simnodes.py` with `resume` and the address list: they follow the leader as the agent does,
and report A's exit in their Hello after the kill). `--quick`: 2 real agents and 20 simulated
nodes, once each. A fresh etcd and three fresh coordinators every run.

The run checks that A SUCCEEDED in the round it ran before the kill (no worker restarted) and
that B SUCCEEDED (real agents) or runs on every node (simulated ones).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench._common import GELASTIC, Measurement, log
from bench._etcd import EtcdCluster, etcd_binary
from bench._simnodes import CoordinatorProcess, SimFleet, sim_job_spec, wait_round_started
from client import Client, GelasticError, JobSpec, JobState
from gelastic.local import poll_until
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

SCENARIO = "failover"
REPLICAS = 3
LEADER_TTL = 3.0
REAL_NODES = 2
SIM_NODES = 1000
QUICK_SIM_NODES = 20
LEASE, HEARTBEAT = 10.0, 1.0
"""Node lease and heartbeat: long enough that no node is lost over a failover."""
SETTLE_S = 1.0
POLL_S = 0.02
EVENTS_POLL_S = 0.25
"""How often the new leader's events are read: their timestamps are the leader's own, so this
changes only what the reading costs the leader (a thousand nodes' adoptions are thousands of
events), not what is measured."""
TIMEOUT = 60.0
GATE_WORKER = (
    "import os, sys, time\n"
    "deadline = time.monotonic() + 120\n"
    "while not os.path.exists(os.environ['BENCH_GATE']):\n"
    "    if time.monotonic() > deadline:\n"
    "        sys.exit(2)\n"
    "    time.sleep(0.01)\n"
)


@dataclass
class _Run:
    serving: float | None
    """The kill -> the first call the new leader answered: the benchmark's or an agent's."""
    adopted: float | None
    queued_started: float | None
    detail: str = ""
    answered: float | None = None
    """The kill -> the first answer to the benchmark's own call."""


class _Replicas:
    """A fresh etcd and three coordinators on it; `leader()` finds the one that leads."""

    def __init__(self) -> None:
        self.etcd = EtcdCluster(1)
        self.coords: list[CoordinatorProcess] = []

    def start(self) -> _Replicas:
        self.etcd.start()
        store = ("--store", self.etcd.url("gelastic"), "--leader-ttl", f"{LEADER_TTL:g}")
        for _ in range(REPLICAS):
            coord = CoordinatorProcess(
                lease=LEASE, heartbeat_interval=HEARTBEAT, log_level="WARNING", extra_args=store
            )
            self.coords.append(coord)
            coord.start()
        return self

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.coords]

    def leader(self, timeout: float, among: list[int] | None = None) -> int | None:
        """Index of the first coordinator (of `among`) that answers a client call: a GetJob of
        a job that does not exist, which only the leader answers (NOT_FOUND) and which costs
        it nothing, whatever the size of the cluster."""
        deadline = time.monotonic() + timeout
        candidates = among if among is not None else list(range(len(self.coords)))
        channels = {i: grpc.insecure_channel(self.coords[i].address) for i in candidates}
        probe = pb.GetJobRequest(job_id="bench-no-such-job")
        try:
            while True:
                for i, ch in channels.items():
                    try:
                        pb_grpc.CoordinatorStub(ch).GetJob(probe, timeout=1.0)
                        return i
                    except grpc.RpcError as exc:
                        if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND:
                            return i
                if time.monotonic() > deadline:
                    return None
                time.sleep(POLL_S)
        finally:
            for ch in channels.values():
                ch.close()

    def stop(self) -> None:
        for c in self.coords:
            c.stop(grace=5.0)
        self.etcd.stop()


class _Agents:
    """Real `nodeagent` processes given the list of coordinators."""

    def __init__(self, addresses: list[str], n: int) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="gelastic-bench-agents-"))
        self.addresses = addresses
        self.names = [f"node-{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> _Agents:
        for name in self.names:
            home = self.workdir / name
            (home / "tmp").mkdir(parents=True)
            with open(home / "agent.out", "ab") as out:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable, "-m", "nodeagent.cli",
                            "--coordinator", ",".join(self.addresses),
                            "--name", name, "--slots", "1",
                            "--log-dir", str(home / "logs"), "--state-dir", str(home / "state"),
                            "--log-level", "WARNING",
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "TMPDIR": str(home / "tmp")},
                        start_new_session=True,
                    )
                )  # fmt: skip
        return self

    def stop(self) -> None:
        """SIGTERM (the agent stops its workers), SIGKILL to the group after 15 s; bounded."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _live(client: Client, names: set[str]) -> bool:
    return names <= {n.name for n in client.list_nodes() if n.state == "live"}


def _last_seq(client: Client, job_id: str) -> int:
    return max(e.seq for e in client.events(job_id))


def _measure(
    replicas: _Replicas, leader: int, a: str, b: str, nodes: set[str], seq_a: int, t0: float
) -> _Run:
    """After the kill: the new leader's first answer, then its events of A and B."""
    survivors = [i for i in range(len(replicas.coords)) if i != leader]
    new = replicas.leader(TIMEOUT, among=survivors)
    if new is None:
        return _Run(None, None, None, f"no coordinator answered within {TIMEOUT:g} s")
    answered = time.time() - t0
    adopted: dict[str, float] = {}
    started: dict[str, float] = {}
    after_b = 0
    detail = ""
    deadline = time.monotonic() + TIMEOUT
    with Client(replicas.coords[new].address, timeout=5.0) as client:
        while True:
            try:
                for e in client.events(a, seq_a):
                    seq_a = max(seq_a, e.seq)
                    if e.kind == "adopted" and e.node in nodes:
                        adopted.setdefault(e.node, e.timestamp)
                for e in client.events(b, after_b):
                    after_b = max(after_b, e.seq)
                    if e.kind == "workers_started" and e.node in nodes:
                        started.setdefault(e.node, e.timestamp)
            except GelasticError as exc:
                detail = f"last error: {exc}"
            # An agent adopted is a call the new leader answered too: one it held while no
            # leader was known is answered as it serves, before the benchmark's own call.
            serving = min(answered, min(adopted.values(), default=math.inf) - t0)
            if len(adopted) == len(nodes) and len(started) == len(nodes):
                return _Run(
                    serving,
                    max(adopted.values()) - t0,
                    max(started.values()) - t0,
                    answered=answered,
                )
            detail = f"{len(adopted)}/{len(nodes)} adopted, B started on {len(started)}"
            if time.monotonic() > deadline:
                return _Run(
                    serving,
                    max(adopted.values()) - t0 if len(adopted) == len(nodes) else None,
                    None,
                    detail,
                    answered,
                )
            time.sleep(EVENTS_POLL_S)


def _check_a(client: Client, a: str, round_: int) -> None:
    st = client.job(a).status()
    if st.state != JobState.SUCCEEDED or st.round != round_ or st.attempt != 0:
        raise RuntimeError(
            f"job A is {st.state.value} in attempt {st.attempt} round {st.round} (it ran in "
            f"round {round_}): {st.reason}"
        )


# ---- real agents ------------------------------------------------------------------------------


def _real_run() -> _Run:
    replicas = _Replicas()
    agents: _Agents | None = None
    gate_dir = Path(tempfile.mkdtemp(prefix="gelastic-bench-gate-"))
    gate = gate_dir / "open"
    try:
        replicas.start()
        leader = replicas.leader(30.0)
        if leader is None:
            raise RuntimeError("no coordinator leads")
        agents = _Agents(replicas.addresses, REAL_NODES).start()
        nodes = set(agents.names)
        with Client(replicas.coords[leader].address, timeout=10.0) as client:
            poll_until(lambda: _live(client, nodes), 30, what="the agents to register")
            spec_a = JobSpec(
                entrypoint=[sys.executable, "-c", GATE_WORKER],
                nproc_per_node=1,
                min_nodes=REAL_NODES,
                max_nodes=REAL_NODES,
                env={"BENCH_GATE": str(gate)},
                name="bench-failover-a",
            )
            a = client.submit(spec_a).job_id
            b = client.submit(
                JobSpec(
                    entrypoint=["/bin/true"],
                    nproc_per_node=1,
                    min_nodes=REAL_NODES,
                    max_nodes=REAL_NODES,
                    name="bench-failover-b",
                )
            ).job_id
            poll_until(
                lambda: _running(client, a, REAL_NODES), 30, interval=POLL_S, what="job A to run"
            )
            time.sleep(SETTLE_S)
            if client.job(b).status().state != JobState.QUEUED:
                raise RuntimeError("job B is not waiting in the queue")
            round_a = client.job(a).status().round
            seq_a = _last_seq(client, a)
        t0 = time.time()
        replicas.coords[leader].kill()
        gate.write_text("open")
        run = _measure(replicas, leader, a, b, nodes, seq_a, t0)
        if run.queued_started is not None:
            new = replicas.leader(10.0, among=[i for i in range(REPLICAS) if i != leader])
            assert new is not None
            with Client(replicas.coords[new].address, timeout=10.0) as client:
                _check_a(client, a, round_a)
                poll_until(
                    lambda: client.job(b).status().state == JobState.SUCCEEDED,
                    30,
                    what="job B to succeed",
                )
        return run
    finally:
        replicas.stop()  # the coordinators first: agents leaving would be node losses
        if agents is not None:
            agents.stop()
        shutil.rmtree(gate_dir, ignore_errors=True)


def _running(client: Client, job_id: str, n: int) -> bool:
    st = client.job(job_id).status()
    return st.state == JobState.RUNNING and len([w for w in st.workers if w.pid]) == n


# ---- simulated nodes --------------------------------------------------------------------------


def _sim_run(n: int) -> _Run:
    replicas = _Replicas()
    fleet: SimFleet | None = None
    try:
        replicas.start()
        leader = replicas.leader(30.0)
        if leader is None:
            raise RuntimeError("no coordinator leads")
        fleet = SimFleet(
            ",".join(replicas.addresses), n, processes=2 if n > 100 else 1, resume=True
        )
        fleet.start()
        fleet.wait_welcomed(60.0)
        with Client(replicas.coords[leader].address, timeout=30.0) as client:
            a = client.submit(sim_job_spec(n, name="bench-failover-a")).job_id
            times = wait_round_started(fleet, client, a, 60.0)
            if times.all_started is None:
                raise RuntimeError(f"job A did not start on {n} simulated nodes")
            b = client.submit(sim_job_spec(n, name="bench-failover-b")).job_id
            time.sleep(SETTLE_S)
            if client.job(b).status().state != JobState.QUEUED:
                raise RuntimeError("job B is not waiting in the queue")
            round_a = client.job(a).status().round
            seq_a = _last_seq(client, a)
        nodes = {f"sim-{i:05d}" for i in range(n)}
        t0 = time.time()
        replicas.coords[leader].kill()
        fleet.finish(a)
        run = _measure(replicas, leader, a, b, nodes, seq_a, t0)
        if run.queued_started is not None:
            new = replicas.leader(10.0, among=[i for i in range(REPLICAS) if i != leader])
            assert new is not None
            with Client(replicas.coords[new].address, timeout=30.0) as client:
                _check_a(client, a, round_a)
        return run
    finally:
        replicas.stop()
        if fleet is not None:
            fleet.stop()


# ---- the scenario -----------------------------------------------------------------------------


def run(runs: int, quick: bool) -> list[Measurement]:
    if etcd_binary() is None:
        log(f"  {SCENARIO}: etcd is not installed; skipped")
        return []
    sim_n = QUICK_SIM_NODES if quick else SIM_NODES
    out: list[Measurement] = []
    for label, one_run in (
        (f"{REAL_NODES} agents", _real_run),
        (f"{sim_n} simulated agents", lambda: _sim_run(sim_n)),
    ):
        serving = Measurement(SCENARIO, f"{label}: kill -> new leader serving", GELASTIC)
        answered = Measurement(SCENARIO, f"{label}: kill -> a client answered", GELASTIC)
        adopted = Measurement(SCENARIO, f"{label}: kill -> all adopted", GELASTIC)
        started = Measurement(SCENARIO, f"{label}: kill -> queued job started", GELASTIC)
        failures: list[str] = []
        for i in range(runs):
            r = one_run()
            serving.add(r.serving)
            answered.add(r.answered)
            adopted.add(r.adopted)
            started.add(r.queued_started)
            if r.queued_started is None:
                failures.append(f"run {i + 1}: {r.detail}")

            def fmt(v: float | None) -> str:
                return "timed out" if v is None else f"{v:.3f} s"

            log(
                f"  {SCENARIO} {label} run {i + 1}/{runs}: serving {fmt(r.serving)} (a client "
                f"answered {fmt(r.answered)}), all adopted {fmt(r.adopted)}, queued job started "
                f"{fmt(r.queued_started)}"
            )
        started.note = "; ".join(
            [f"--leader-ttl {LEADER_TTL:g}; target: serving within TTL + 1 s", *failures]
        )
        out += [serving, answered, adopted, started]
    return out
