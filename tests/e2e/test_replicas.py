"""Three `coordinator serve` replicas on one etcd, real agents that follow the leader.

- The leader is killed with SIGKILL while a job runs: a standby takes over once the lease ran
  out, loads the state and adopts the agents; the job finishes with the workers it had (no
  worker started again), a job queued before the kill runs, and a job that finished before is
  still there with its result.
- The leader is cut from etcd (a blackhole route in its network namespace) but not from its
  agents: it steps down on its own timer before etcd could expire its lease, a standby is
  elected, the agents follow it, and nothing is assigned twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from client import JobSpec, JobState, WorkerState
from gelastic.local import LocalCluster, StartedProcess, poll_until, stop_processes
from tests._etcd import EtcdServer, etcd_binary
from tests._helpers import free_port
from tests.e2e.conftest import PY, Gate, script

TTL = 2.0
TIMEOUT = 60


def _leader_addr(etcd: EtcdServer, prefix: str) -> str:
    """The address in PREFIX/leader ("" when no replica leads)."""
    from protos.etcd import rpc_pb2 as epb
    from protos.etcd import rpc_pb2_grpc as epb_grpc

    with etcd.channel() as ch:
        resp = epb_grpc.KVStub(ch).Range(
            epb.RangeRequest(key=f"{prefix}/leader".encode()), timeout=5
        )
    if not resp.kvs:
        return ""
    addr: str = json.loads(resp.kvs[0].value)["addr"]
    return addr


class Replicas(LocalCluster):
    """A LocalCluster whose coordinator is three replicas on one etcd prefix."""

    def __init__(self, store: str, workdir: Path, n: int = 3, **kw: Any) -> None:
        super().__init__(
            nodes=2,
            slots=2,
            workdir=workdir,
            coordinator_args=["--store", store, "--leader-ttl", str(TTL)],
            **kw,
        )
        self.ports = [free_port() for _ in range(n)]
        self.replicas: dict[int, StartedProcess] = {}

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_replica(self, i: int) -> None:
        port_file = self.workdir / f"coordinator-{i}.port"
        port_file.unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", "coordinator.cli", "serve",
            "--port", str(self.ports[i]), "--port-file", str(port_file),
            "--lease", str(self.lease), "--heartbeat-interval", str(self.heartbeat_interval),
            "--state-dir", str(self.workdir / f"coordinator-state-{i}"),
            "--token-file", self.token_file, *self.coordinator_args,
        ]  # fmt: skip
        proc = self._spawn(f"coordinator-{i}", argv)
        self.replicas[i] = proc
        poll_until(
            lambda: port_file.exists() or proc.popen.poll() is not None,
            30,
            what=f"replica {i} to listen",
        )
        assert proc.popen.poll() is None, self._tail(f"coordinator-{i}")

    def start(self) -> Replicas:
        for i in range(len(self.ports)):
            self.start_replica(i)
        for i in range(self.n_nodes):
            self.start_agent(f"node-{i}", wait=False)
        names = {f"node-{i}" for i in range(self.n_nodes)}
        self.wait_nodes(lambda live: names <= live, f"{self.n_nodes} nodes to register")
        return self

    def kill_replica(self, i: int) -> None:
        proc = self.replicas.pop(i)
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=30)
        proc.log.close()

    def stop(self, timeout: float = 20.0, grace: float = 5.0) -> list[Any]:
        killed = stop_processes(list(self.agents.values()), timeout)
        self.agents.clear()
        killed += stop_processes(list(self.replicas.values()), timeout)
        self.replicas.clear()
        killed += super().stop(timeout, grace)
        self.killed = killed
        return killed


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _healthy_pids(job: Any) -> set[int]:
    return {w.pid for w in job.status().workers if w.pid and w.state == WorkerState.HEALTHY}


def test_the_leader_killed_mid_job_a_standby_takes_over_and_the_job_finishes(
    etcd: EtcdServer, tmp_path: Path, out: Path, gate: Gate
) -> None:
    cluster = Replicas(etcd.url("gelastic"), tmp_path / "cluster")
    try:
        cluster.start()
        client = cluster.client
        one = JobSpec(entrypoint=[PY, "-c", "print('done')"], min_nodes=1, max_nodes=1)
        old = client.submit(one)
        assert old.wait(TIMEOUT).state == WorkerState.SUCCEEDED
        spec = JobSpec(
            entrypoint=[PY, script("crash_once.py")],
            nproc_per_node=2,
            min_nodes=2,
            max_nodes=2,
            env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
        )
        job = client.submit(spec)
        gate.wait("start", 4)
        poll_until(lambda: len(_healthy_pids(job)) == 4, TIMEOUT, what="4 workers running")
        pids = _healthy_pids(job)
        # Every slot is taken: this one waits in the queue.
        queued = client.submit(one)
        assert queued.status().state in (JobState.QUEUED, JobState.RENDEZVOUS)

        leader = _leader_addr(etcd, "gelastic")
        index = [f"127.0.0.1:{p}" for p in cluster.ports].index(leader)
        killed_at = time.monotonic()
        cluster.kill_replica(index)
        poll_until(
            lambda: _leader_addr(etcd, "gelastic") not in ("", leader),
            TTL + 15,
            what="a standby to lead",
        )
        took_over = time.monotonic() - killed_at
        assert took_over > TTL / 2  # it waited for the lease, not less
        # The agents are adopted with their workers: same pids, still healthy.
        poll_until(lambda: _healthy_pids(job) == pids, TIMEOUT, what="the workers adopted")
        gate.open("finish")
        result = job.wait(TIMEOUT)
        assert result.state == WorkerState.SUCCEEDED, result.format_failures()
        assert len(gate.events("start")) == 4, "a worker was started again"
        assert not list(out.glob("attempt1_*.json")), "a worker was started again"
        assert queued.wait(TIMEOUT).state == WorkerState.SUCCEEDED
        again = old.poll()
        assert again is not None and again.state == WorkerState.SUCCEEDED
        ids = {j.job_id for j in client.list_jobs(include_finished=True)}
        assert ids == {old.job_id, job.job_id, queued.job_id}
    finally:
        cluster.stop()
    assert not cluster.killed, cluster.killed


# ---- the partition -------------------------------------------------------------------------


def _netns_etcd(host: Any, workdir: Path, log: IO[bytes]) -> Any:
    """etcd in its own namespace, on `host`'s address, its output to `log`."""
    import subprocess

    workdir.mkdir(parents=True, exist_ok=True)
    client = f"http://{host.addr}:2379"
    peer = f"http://{host.addr}:2380"
    argv = [
        "ip", "netns", "exec", host.netns, etcd_binary(),
        "--name", "default", "--data-dir", str(workdir / "data"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"default={peer}", "--log-level", "warn",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


STEP_DOWN = re.compile(
    r"this replica stops leading \(epoch (\d+)\): no keepalive of the leader lease was "
    r"confirmed for ([0-9.]+) s"
)


def test_a_leader_cut_from_etcd_steps_down_before_its_lease_expires(
    tmp_path: Path, out: Path, gate: Gate
) -> None:
    import grpc

    from protos.etcd import rpc_pb2 as epb
    from protos.etcd import rpc_pb2_grpc as epb_grpc
    from tests.e2e._netns import Lab, NetnsCluster, ip, require_netns

    require_netns()
    with Lab() as lab:
        etcd_host = lab.add_host("etcd", 2)
        coords = [lab.add_host(f"coord-{i}", 3 + i) for i in range(3)]
        nodes = [lab.add_host(f"node-{i}", 11 + i) for i in range(2)]
        (tmp_path / "etcd").mkdir()
        etcd_log = (tmp_path / "etcd" / "etcd.log").open("ab")
        etcd_proc = _netns_etcd(etcd_host, tmp_path / "etcd", etcd_log)
        cluster = NetnsCluster(
            lab, tmp_path / "cluster", lease=3.0, heartbeat_interval=0.5, slots=2
        )
        endpoint = f"{etcd_host.addr}:2379"

        def leader() -> str:
            with grpc.insecure_channel(endpoint) as ch:
                resp = epb_grpc.KVStub(ch).Range(
                    epb.RangeRequest(key=b"gelastic/leader"), timeout=5
                )
            return str(json.loads(resp.kvs[0].value)["addr"]) if resp.kvs else ""

        def etcd_answers() -> bool:
            try:
                leader()
                return True
            except grpc.RpcError:
                return False

        try:
            poll_until(etcd_answers, 30, interval=0.1, what="etcd to answer")
            addrs = [f"{h.addr}:29400" for h in coords]
            for i, h in enumerate(coords):
                argv = [
                    sys.executable, "-m", "coordinator.cli", "serve",
                    "--host", h.addr, "--port", "29400", "--insecure",
                    "--lease", "3", "--heartbeat-interval", "0.5",
                    "--state-dir", str(tmp_path / f"state-{i}"),
                    "--store", f"etcd://{endpoint}/gelastic", "--leader-ttl", str(TTL),
                ]  # fmt: skip
                cluster._spawn(f"coordinator-{i}", h, argv)
            cluster.address = ",".join(addrs)
            poll_until(lambda: leader() != "", 30, what="a leader")
            for h in nodes:
                cluster.start_agent(h)
            poll_until(
                lambda: {"node-0", "node-1"} <= set(cluster.live_nodes()),
                30,
                what="2 agents to register",
            )
            job = cluster.client.submit(
                JobSpec(
                    entrypoint=[PY, script("crash_once.py")],
                    nproc_per_node=2,
                    min_nodes=2,
                    max_nodes=2,
                    env={"OUT_DIR": str(out), "CRASH_UNTIL": "0", **gate.env},
                )
            )
            gate.wait("start", 4)
            poll_until(lambda: len(_healthy_pids(job)) == 4, TIMEOUT, what="4 workers running")
            pids = _healthy_pids(job)

            first = leader()
            index = addrs.index(first)
            # Cut the leader from etcd, and from etcd only: its agents still reach it.
            ip("-n", coords[index].netns, "route", "add", "blackhole", f"{etcd_host.addr}/32")
            poll_until(
                lambda: leader() not in ("", first), TTL + 20, what="another replica to lead"
            )
            log = cluster.output(f"coordinator-{index}")
            found = STEP_DOWN.search(log)
            assert found, log[-3000:]
            # On its own timer, measured from the send of the last keepalive etcd confirmed:
            # etcd counts the TTL from later than that, so the lease was still alive there.
            assert float(found.group(2)) < TTL, found.group(0)
            # The agents follow the new leader, which adopts their workers: nothing restarts.
            poll_until(lambda: _healthy_pids(job) == pids, TIMEOUT, what="the workers adopted")
            gate.open("finish")
            result = job.wait(TIMEOUT)
            assert result.state == WorkerState.SUCCEEDED, result.format_failures()
            starts = gate.events("start")
            assert len(starts) == 4 and {e["pid"] for e in starts} == pids, starts
            assert not list(out.glob("attempt1_*.json")), "a worker was started again"
        finally:
            cluster.stop()
            etcd_proc.send_signal(signal.SIGTERM)
            try:
                etcd_proc.wait(timeout=10)
            except Exception:
                etcd_proc.kill()
                etcd_proc.wait(timeout=10)
            etcd_log.close()
            killed = cluster.kill_leftovers()
    # Only reached when the test body passed: everything must have exited on its own.
    assert not killed, f"processes left behind (killed now): {killed}"
