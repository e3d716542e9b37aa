"""`gelastic run` on every node: one node of a job that several launchers form together.

Every node runs the same command line (srun, a PyTorchJob's pods, ssh). Each embeds a node
agent; the coordinator is embedded as the rendezvous says:

- c10d: the launcher that owns the endpoint's host (or says `is_host=true`) hosts it on the
  endpoint's port; when several launchers share that host, the first to bind the port does.
- static: node rank 0 hosts it at --master-addr:--master-port.
- etcd: every launcher runs a coordinator replica on that etcd, and the replicas elect a leader:
  losing any node, the leader's included, re-forms the job instead of ending it.

All submit the same spec under one key made of the rendezvous id, so they make one job; a node
whose spec differs is refused, naming the difference, and exits 2. Each waits for the job to end
(the exit barrier) and exits as torchrun does: 0 when it succeeded, 1 otherwise, the root cause
printed once per node. The node hosting the coordinator stays until the others have left, so
they learn the outcome. A node whose c10d/static host is gone stops its workers and exits 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import grpc

from client import Client, GelasticError, Job
from client.model import JobState, RunResult
from client.security import Security, is_loopback
from gelastic._cli_run import (
    CoordinatorSetup,
    EmbeddedCluster,
    Interrupted,
    _report,
    _say,
    _SignalGuard,
    settled,
)
from gelastic._cli_run import main as _run_main
from gelastic._rdzv import MultiNode, bind_address, endpoint_is_local
from gelastic._run_plan import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PREFIX_TEMPLATE_ENV, RunPlan

__all__ = ["execute_node", "main"]

HOST_LOST_S = 3.0
"""c10d/static: seconds without a session to the host's coordinator before the host counts as
gone (its launcher died: the connection is refused at once, so this only rides out a blip)."""
NEVER_CONNECTED_S = 10.0
"""Seconds after the job took this node's submit within which its agent must reach the
coordinator; past them the coordinator counts as gone too."""
HOST_LINGER_MIN_S = 2.0
"""The hosting node stays at least this long after the job ended: a node whose submit the job
took just before its end is still starting its agent."""
REPLICAS_LOST_S = 30.0
"""etcd: seconds without a session to any replica before the run is given up."""
REPLICA_RECONNECT_GRACE_S = 5.0
"""etcd: seconds a node has to reach the new leader after a takeover before it counts as lost."""
POLL_S = 0.05
AGENT_RECONNECT_MAX_S = 0.5
"""A node that came before the coordinator listens tries again at least this often."""


class NodeExit(Exception):
    """This node's run ends with `code`, for the reason in the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Outcome:
    result: RunResult | None = None
    state: JobState | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _warn_open_door(mn: MultiNode) -> None:
    if mn.token_file:
        if not is_loopback(mn.host):
            _say(
                f"the token in {mn.token_file} crosses the network in plain text: keep the "
                "nodes on a network only they share"
            )
        return
    where = "this host" if is_loopback(mn.host) else "the network"
    _say(
        f"WARNING: no token (--rdzv-conf token_file=PATH or $GELASTIC_TOKEN_FILE): anyone on "
        f"{where} who reaches {mn.endpoint if mn.backend != 'etcd' else 'a replica'} can run "
        "programs on every node of this job"
    )


def _route_address(host: str, port: int) -> str:
    """The local address that routes to host (no packet is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1" if is_loopback(host) else socket.getfqdn()


def _start(
    plan: RunPlan, mn: MultiNode, log_dir: str, state_dir: str
) -> tuple[EmbeddedCluster, bool]:
    """(the started node, whether it hosts the job's coordinator or a replica of it)."""

    def node(setup: CoordinatorSetup | None, target: str) -> EmbeddedCluster:
        return EmbeddedCluster(
            slots=plan.spec.nproc_per_node,
            log_dir=log_dir,
            state_dir=state_dir,
            dashboard_port=plan.dashboard_port if setup is not None else None,
            addr=mn.local_addr,
            name=mn.node_name,
            coordinator=setup,
            target=target,
            token_file=mn.token_file,
            insecure=True,  # what it means was said by _warn_open_door
            wait_connected=False,
            reconnect_max=AGENT_RECONNECT_MAX_S,
            agent_later=True,
        )

    if mn.backend == "etcd":
        addr = mn.local_addr or _route_address(mn.host, mn.port)
        setup = CoordinatorSetup(
            host=addr,
            port=mn.conf.replica_port,
            token_file=mn.token_file,
            private_token=False,
            insecure=True,
            store=mn.etcd_store,
            leader_ttl=mn.conf.leader_ttl,
            # Every agent follows the new leader within a second of its election: a node not
            # back by then is gone with the old leader's host.
            reconnect_grace=REPLICA_RECONNECT_GRACE_S,
        )
        cluster = node(setup, "")
        try:
            cluster.start()
        except OSError as exc:
            cluster.stop(0)
            raise NodeExit(
                EXIT_FAILED, f"cannot start this node's coordinator replica: {exc}"
            ) from None
        return cluster, True
    chosen = mn.conf.is_host
    if chosen is None and mn.backend == "static" and mn.node_rank is not None:
        chosen = mn.node_rank == 0
    hosting = chosen if chosen is not None else endpoint_is_local(mn.host)
    if hosting:
        setup = CoordinatorSetup(
            host=bind_address(mn.host),
            port=mn.port,
            token_file=mn.token_file,
            private_token=False,
            insecure=True,
        )
        cluster = node(setup, mn.endpoint)
        try:
            cluster.start()
            return cluster, True
        except OSError as exc:
            cluster.stop(0)
            if chosen is not None:
                raise NodeExit(
                    EXIT_FAILED, f"cannot host the rendezvous at {mn.endpoint}: {exc}"
                ) from None
            # Most likely another launcher on this host bound it first: it hosts, this one
            # joins (as torch's c10d backend does when its guess that it is the host fails).
            # Were it anything else, no coordinator answers and the join timeout says why.
            cluster = node(None, mn.endpoint)
            cluster.bind_failure = " ".join(str(exc).split())[:300]
            cluster.start()
            return cluster, False
    cluster = node(None, mn.endpoint)
    cluster.start()
    return cluster, False


def _client(cluster: EmbeddedCluster, mn: MultiNode) -> Client:
    target = cluster.address if mn.backend == "etcd" else mn.endpoint
    security = Security.from_files(mn.token_file, insecure=True)
    return Client(target, security=security, timeout=10.0)


def _follow_replicas(cluster: EmbeddedCluster, client: Client, own: str) -> None:
    """etcd: the client and the agent may go to the leader this node's replica knows of."""
    listed = cluster.replicas()
    if listed and client.addresses != listed:
        client.addresses = listed
    cluster.follow(listed or (own,))


def _submit(client: Client, plan: RunPlan, mn: MultiNode, cluster: EmbeddedCluster) -> Job:
    """Submit under the run's key, waiting (up to join_timeout) for a coordinator to answer."""
    deadline = time.monotonic() + max(mn.conf.join_timeout, 1.0)
    last = ""
    while True:
        if mn.backend == "etcd":
            _follow_replicas(cluster, client, cluster.address)
        try:
            return client.submit(plan.spec, request_id=mn.request_id)
        except GelasticError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in str(exc):
                differs = str(exc).split("): ", 1)[-1]
                raise NodeExit(
                    EXIT_USAGE,
                    f"this node's command line differs from the job the other nodes of "
                    f"--rdzv-id {mn.run_id} formed: {differs}",
                ) from None
            if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                held = f"the token in {mn.token_file}" if mn.token_file else "no token"
                raise NodeExit(
                    EXIT_USAGE,
                    f"the coordinator at {client.address} refused this node, which holds {held}: "
                    "every node needs the same token (--rdzv-conf token_file=PATH or "
                    f"$GELASTIC_TOKEN_FILE) ({' '.join(str(exc).split())[:200]})",
                ) from None
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            last = " ".join(str(exc).split())[:300]
        if time.monotonic() > deadline:
            where = mn.endpoint if mn.backend != "etcd" else f"etcd at {mn.endpoint}"
            raise NodeExit(
                EXIT_FAILED,
                f"no coordinator answered at {where} within join_timeout "
                f"({mn.conf.join_timeout:g} s): is the host node up and reachable? ({last})"
                + (
                    f"; this node could not host it either: {cluster.bind_failure}"
                    if cluster.bind_failure
                    else ""
                ),
            )
        time.sleep(0.2)


def _wait(
    job: Job, plan: RunPlan, mn: MultiNode, cluster: EmbeddedCluster, client: Client, hosting: bool
) -> _Outcome:
    """Wait for the job to end, watching this node's session: the c10d host gone ends it."""
    out = _Outcome()

    def wait() -> None:
        try:
            out.result = job.wait(progress=plan.progress, out=sys.stderr)
            out.state = job.status().state
        except BaseException as exc:  # handed to the main thread
            out.error = exc
        finally:
            out.done.set()

    thread = threading.Thread(target=wait, name="gelastic-run-wait", daemon=True)
    thread.start()
    seen = False
    lost_since: float | None = None
    waiting_since = time.monotonic()
    while not out.done.wait(POLL_S):
        if mn.backend == "etcd":
            _follow_replicas(cluster, client, cluster.address)
        if cluster.agent_refusal:
            raise NodeExit(EXIT_USAGE, cluster.agent_refusal)
        if cluster.agent_connected:
            seen, lost_since = True, None
            continue
        if hosting and mn.backend != "etcd":
            continue
        now = time.monotonic()
        if seen:
            lost_since = now if lost_since is None else lost_since
            bound = REPLICAS_LOST_S if mn.backend == "etcd" else HOST_LOST_S
        else:
            # Never reached the coordinator since the job took this node's submit.
            lost_since = waiting_since
            bound = max(NEVER_CONNECTED_S, REPLICAS_LOST_S if mn.backend == "etcd" else 0.0)
        if now - lost_since > bound:
            if mn.backend == "etcd":
                raise NodeExit(
                    EXIT_FAILED,
                    f"no coordinator replica has answered this node for {bound:g} s "
                    f"(is etcd at {mn.endpoint} up?); stopping this node's workers",
                )
            raise NodeExit(
                EXIT_FAILED,
                f"the rendezvous host at {mn.endpoint} is gone (no session for {bound:g} s: its "
                "launcher ended or its host is down); stopping this node's workers. With "
                "--rdzv-backend etcd the job would go on without it",
            )
    if out.error is not None:
        raise out.error
    return out


def _linger(client: Client, mn: MultiNode, cluster: EmbeddedCluster) -> None:
    """Serve, for at most close_timeout, until every other node has left (learned the end)."""
    start = time.monotonic()
    deadline = start + mn.conf.close_timeout
    while time.monotonic() < deadline:
        try:
            nodes = client.list_nodes()
        except GelasticError:
            return
        others = any(n.name != mn.node_name and n.state != "lost" for n in nodes)
        if not others and time.monotonic() - start >= min(HOST_LINGER_MIN_S, mn.conf.close_timeout):
            return
        time.sleep(0.1)


def execute_node(plan: RunPlan, mn: MultiNode) -> int:
    """Run this node's part of the job; return torchrun's exit code."""
    os.environ.setdefault(PREFIX_TEMPLATE_ENV, plan.prefix_template)
    own_log_dir = plan.log_dir is None
    log_dir = plan.log_dir or tempfile.mkdtemp(prefix="gelastic-run-")
    state_dir = tempfile.mkdtemp(prefix="gelastic-run-state-")
    _warn_open_door(mn)
    cluster: EmbeddedCluster | None = None
    client: Client | None = None
    code = EXIT_FAILED
    keep_logs = True
    grace = plan.spec.stop_grace
    leave = False
    with _SignalGuard() as guard:
        try:
            cluster, hosting = _start(plan, mn, log_dir, state_dir)
            if plan.progress:
                role = {True: "hosts the rendezvous", False: "joins the rendezvous"}[hosting]
                if mn.backend == "etcd":
                    role = f"runs a coordinator replica at {cluster.address} on etcd"
                _say(f"node {mn.node_name} {role} at {mn.endpoint} (--rdzv-id {mn.run_id})")
            if cluster.dashboard_url:
                _say(f"dashboard: {cluster.dashboard_url}")
            client = _client(cluster, mn)
            job = _submit(client, plan, mn, cluster)
            # Only a node whose spec the job took joins: one refused never runs a worker.
            cluster.start_agent()
            outcome = _wait(job, plan, mn, cluster, client, hosting)
            assert outcome.result is not None and outcome.state is not None
            code = EXIT_OK if outcome.state == JobState.SUCCEEDED else EXIT_FAILED
            keep_logs = code != EXIT_OK
            result = settled(job, outcome.result, grace)
            _report(plan, outcome.state, result, local_error_files=False)
            if hosting:
                cluster.stop_agent(grace)
                if mn.backend != "etcd" or cluster.leading:
                    _linger(client, mn, cluster)
        except Interrupted as exc:
            # A graceful stop of one node: it leaves the job first (a re-form on the others, no
            # restart spent), then its workers get their grace.
            leave = True
            _say(
                f"{signal.Signals(exc.signum).name}: this node leaves the job; stopping its workers"
            )
        except NodeExit as exc:
            _say(str(exc))
            code = exc.code
        except (GelasticError, TimeoutError, OSError, ValueError) as exc:
            _say(" ".join(str(exc).split()) or type(exc).__name__)
        finally:
            guard.cleaning = True
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.stop(grace, leave_first=leave)
            shutil.rmtree(state_dir, ignore_errors=True)
            if own_log_dir:
                if keep_logs:
                    _say(f"worker logs are in {log_dir}")
                else:
                    shutil.rmtree(log_dir, ignore_errors=True)
        if guard.received is not None:
            return EXIT_FAILED
    return code


def main(argv: list[str]) -> int:
    """`gelastic run`, on one host or as one node of several."""
    return _run_main(argv, run_node=execute_node)
