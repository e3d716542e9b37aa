"""A scripted fake cluster for `Cluster` tests: fake nodes that answer the coordinator.

The driver owns a fake clock (`now`, moved only by `advance`) and a set of fake nodes. Every
call into the `Cluster` goes through it, so all effects land in `history` and `pending`.
`settle()` plays the agents: it answers RequestPort with port_reserved, AssignRound with
workers_started and StopRound with group_stopped (each agent worker that was still running
reports a stopped_by_agent exit first), until nothing is left to answer. A node can be `mute`d
(it receives but never answers), which is how a hung or dead host looks to the coordinator.

No network, no threads, no sleeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from client.assignment import RoundAssignment
from client.model import GpuDevice, JobSpec, ProcessFailure
from client.node_protocol import GroupStopped, Heartbeat, PortReserved, WorkerExited, WorkersStarted
from coordinator._cluster import (
    AssignRound,
    Cluster,
    ClusterConfig,
    Effect,
    ReleaseRound,
    RequestPort,
    RunningGroupReport,
    StopRound,
    WorkerExitReport,
)

T0 = 1_000_000.0
BASE_PORT = 29500

E = TypeVar("E")


def spec(**kw: Any) -> JobSpec:
    """A valid command spec; keyword arguments override fields."""
    kw.setdefault("entrypoint", ["python", "train.py"])
    s = JobSpec(**kw)
    s.validate()
    return s


@dataclass
class FakeNode:
    name: str
    addr: str
    slots: int
    incarnation: str
    mute: bool = False
    """A mute node answers nothing and sends no heartbeats (a hung agent); see `unmute`."""
    held: list[Effect] = field(default_factory=list)
    """Messages that reached a mute node; it answers them if it comes back in time."""
    auto_stop: bool = True
    """Answer StopRound with group_stopped during settle()."""
    port: int | None = None
    """What to answer RequestPort with: None = BASE_PORT + round, 0 = an error, -1 = nothing."""
    inbox: list[Effect] = field(default_factory=list)
    assignments: dict[str, RoundAssignment] = field(default_factory=dict)
    """The latest assignment per job id."""
    running: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    """(job, round) -> {local_rank: pid} of workers still alive on this node."""


class Driver:
    def __init__(self, config: ClusterConfig | None = None, t0: float = T0) -> None:
        self.cluster = Cluster(config or ClusterConfig(heartbeat_interval=1.0, lease=5.0))
        self.now = t0
        self.nodes: dict[str, FakeNode] = {}
        self.history: list[Effect] = []
        self.pending: list[Effect] = []
        self._next_pid = 1000
        self._incarnations = 0

    # ---- clock ---------------------------------------------------------------------------------

    def advance(self, seconds: float) -> list[Effect]:
        """Move the fake clock, ticking the cluster at least once a second.

        Live, non-mute nodes heartbeat before every tick, as real agents would; mute ones stay
        silent, so their leases run out. No other answers are played (see `settle`).
        """
        end = self.now + seconds
        out: list[Effect] = []
        while True:
            self.now = min(end, self.now + 1.0)
            self.heartbeat_all()
            out += self._take(self.cluster.tick(self.now))
            if self.now >= end:
                return out

    def advance_to(self, t: float) -> list[Effect]:
        return self.advance(t - self.now)

    def heartbeat_all(self) -> None:
        for n in self.nodes.values():
            if not n.mute:
                self.cluster.step(n.name, n.incarnation, Heartbeat(), self.now)

    # ---- the cluster's inputs ------------------------------------------------------------------

    def submit(self, job_id: str, **kw: Any) -> list[Effect]:
        return self._take(self.cluster.submit(job_id, spec(**kw), self.now))

    def cancel(self, job_id: str) -> list[Effect]:
        return self._take(self.cluster.cancel(job_id, self.now))

    def connect(
        self,
        name: str,
        addr: str | None = None,
        slots: int = 1,
        incarnation: str | None = None,
        running: Sequence[RunningGroupReport] = (),
        gpus: Sequence[GpuDevice] = (),
        secret_digest: str = "",
    ) -> list[Effect]:
        if incarnation is None:
            self._incarnations += 1
            incarnation = f"inc-{self._incarnations}"
        node = FakeNode(name, addr or f"10.0.0.{len(self.nodes) + 1}", slots, incarnation)
        old = self.nodes.get(name)
        if old is not None and old.incarnation == incarnation:
            node.assignments, node.running = old.assignments, old.running
        effects = self.cluster.node_connected(
            name,
            node.addr,
            slots,
            incarnation,
            self.now,
            running=running,
            gpus=gpus,
            secret_digest=secret_digest,
        )
        self.nodes[name] = node
        return self._take(effects)

    def unmute(self, name: str) -> None:
        """A hung node wakes up and answers what reached it, unless it was declared lost."""
        n = self.nodes[name]
        n.mute = False
        if self.cluster.node_is_live(name, n.incarnation):
            self.pending += n.held
        n.held = []

    def disconnect(self, name: str) -> list[Effect]:
        n = self.nodes[name]
        n.mute = True
        return self._take(self.cluster.node_disconnected(name, n.incarnation, self.now))

    def exit(
        self,
        name: str,
        local_rank: int,
        exitcode: int = 0,
        *,
        job_id: str | None = None,
        round_: int | None = None,
        timestamp: float | None = None,
        return_value: bytes | None = None,
        stopped_by_agent: bool = False,
        failure: ProcessFailure | None = None,
    ) -> list[Effect]:
        """One worker of `name` exits; job and round default to the node's latest assignment."""
        n = self.nodes[name]
        a = self.assignment(name, job_id)
        round_ = a.round if round_ is None else round_
        pid = n.running.get((a.job_id, round_), {}).pop(local_rank, 0)
        report = WorkerExitReport(
            local_rank=local_rank,
            global_rank=a.workers[local_rank].global_rank,
            pid=pid,
            exitcode=exitcode,
            stopped_by_agent=stopped_by_agent,
            failure=failure,
            return_value=return_value,
            timestamp=self.now if timestamp is None else timestamp,
        )
        return self._take(
            self.cluster.step(name, n.incarnation, WorkerExited(a.job_id, round_, report), self.now)
        )

    def finish(self, name: str, job_id: str | None = None, values: bool = False) -> list[Effect]:
        """Every worker of `name` exits 0 (returning its global rank as bytes when `values`)."""
        a = self.assignment(name, job_id)
        out: list[Effect] = []
        for w in a.workers:
            rv = str(w.global_rank).encode() if values else None
            out += self.exit(name, w.local_rank, 0, job_id=a.job_id, return_value=rv)
        return out

    def reserve_port(
        self, name: str, job_id: str, round_: int, port: int, error: str = ""
    ) -> list[Effect]:
        n = self.nodes[name]
        return self._take(
            self.cluster.step(
                name, n.incarnation, PortReserved(job_id, round_, port, error), self.now
            )
        )

    def group_stopped(self, name: str, job_id: str, round_: int) -> list[Effect]:
        n = self.nodes[name]
        out: list[Effect] = []
        alive = n.running.pop((job_id, round_), {})
        a = n.assignments.get(job_id)
        for lr, pid in sorted(alive.items()):
            if a is None or a.round != round_:
                break
            report = WorkerExitReport(
                local_rank=lr,
                global_rank=a.workers[lr].global_rank,
                pid=pid,
                exitcode=-15,
                stopped_by_agent=True,
                timestamp=self.now,
            )
            out += self._take(
                self.cluster.step(
                    name, n.incarnation, WorkerExited(job_id, round_, report), self.now
                )
            )
        out += self._take(
            self.cluster.step(name, n.incarnation, GroupStopped(job_id, round_, ()), self.now)
        )
        return out

    # ---- playing the agents --------------------------------------------------------------------

    def settle(self, max_steps: int = 1000) -> list[Effect]:
        """Let every non-mute node answer what it was sent, until nothing is left to answer."""
        seen: list[Effect] = []
        for _ in range(max_steps):
            if not self.pending:
                return seen
            eff = self.pending.pop(0)
            seen.append(eff)
            self._answer(eff)
        raise AssertionError("the cluster did not settle")

    def _answer(self, eff: Effect) -> None:
        if not isinstance(eff, RequestPort | AssignRound | StopRound | ReleaseRound):
            return
        n = self.nodes.get(eff.node)
        if n is None:
            return
        if n.mute:
            n.held.append(eff)
            return
        n.inbox.append(eff)
        if isinstance(eff, RequestPort):
            if n.port == -1:
                return
            port = BASE_PORT + eff.round if n.port is None else n.port
            error = "" if port else "no free port"
            self._take(
                self.cluster.step(
                    n.name,
                    n.incarnation,
                    PortReserved(eff.job_id, eff.round, port, error),
                    self.now,
                )
            )
        elif isinstance(eff, AssignRound):
            a = eff.assignment
            n.assignments[a.job_id] = a
            pids = []
            for w in a.workers:
                self._next_pid += 1
                pids.append((w.local_rank, self._next_pid))
            n.running[(a.job_id, a.round)] = dict(pids)
            self._take(
                self.cluster.step(
                    n.name, n.incarnation, WorkersStarted(a.job_id, a.round, tuple(pids)), self.now
                )
            )
        elif isinstance(eff, StopRound) and n.auto_stop:
            self.group_stopped(n.name, eff.job_id, eff.round)

    def _take(self, effects: list[Effect]) -> list[Effect]:
        self.history += effects
        self.pending += effects
        return effects

    # ---- reading the state ---------------------------------------------------------------------

    def assignment(self, name: str, job_id: str | None = None) -> RoundAssignment:
        n = self.nodes[name]
        if job_id is None:
            (job_id,) = n.assignments  # exactly one job on this node, or say which
        return n.assignments[job_id]

    def state(self, job_id: str) -> Any:
        return self.cluster.job_state(job_id)

    def reason(self, job_id: str) -> str:
        return self.cluster.job_status(job_id).reason

    def round(self, job_id: str) -> int:
        return self.cluster.job_status(job_id).round

    def attempt(self, job_id: str) -> int:
        return self.cluster.job_status(job_id).attempt

    def event_kinds(self, job_id: str) -> list[str]:
        return [e.kind for e in self.cluster.job_events(job_id)]

    def clear(self) -> None:
        """Forget effects seen so far (and drop unanswered ones)."""
        self.history.clear()
        self.pending.clear()


def of_type(effects: Iterable[Effect], kind: type[E]) -> list[E]:
    return [e for e in effects if isinstance(e, kind)]


def nodes_of(effects: Iterable[Effect], kind: type[Any]) -> list[str]:
    """The nodes addressed by the effects of one kind, sorted."""
    return sorted(e.node for e in effects if isinstance(e, kind))
