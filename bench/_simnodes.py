"""Simulated node agents for the scale benchmarks, and the coordinator process they talk to.

A simulated node speaks the real NodeSession protocol over gRPC but runs no workers: it says
Hello, heartbeats at the interval the coordinator's Welcome asks for (with health samples for
the workers of the round it holds, when asked to), answers ReservePort with a PortReserved and
Assign with WorkersStarted at once, Stop with GroupStopped, and StartLogs with an error. Many
nodes share one process (one asyncio loop) and a few gRPC channels, so 10,000 nodes fit on a
small host; `SimFleet` spreads them over a few such processes and talks to each over its
stdin/stdout (one JSON line per command and per answer).

With `resume`, a node also behaves like the real agent across a coordinator restart: it keeps
the rounds it holds when its session ends and reports them in the Hello of its next session
(`running=[RunningGroup(job_id, round, attempt, workers=[WorkerPid...], exits=[...])]`), and it
opens a gRPC channel of its own for every session attempt (as the agent does), so no
channel-level connect backoff is shared between nodes or carried from one attempt to the next.
Given a list of coordinator replicas (`--address a,b,c`, with `resume`), it follows the leader
as the agent does (`nodeagent/session.py`): after a session ends it tries the next listed
address, or goes straight (no pause, at most once per listed address in a row) to the leader a
standby names in its `gelastic-leader` metadata when that address is listed; it keeps the
newest leader epoch seen and hangs up on a coordinator whose message carries an older one; and
it names the replica its last session could not reach in its next session's metadata, as the
agent does.

With a progress rate (`progress HZ` on its stdin, 0 = off), every node also sends what the
real agent forwards of its workers' `client.progress`: one ProgressReport per held round twice
a second (the agent's `FORWARD_EVERY_S`), each rank's step advanced by HZ steps a second, its
steps/s and one metric.

`CoordinatorProcess` runs `coordinator serve` as a process of its own, so its CPU time and
peak RSS are measured apart from everything else; `kill()` and `start()` again restart it on
the same port and state directory.

`python -m bench._simnodes --address HOST:PORT --first I --count N ...` is one fleet process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench._sim_coordinator import CoordinatorProcess, cpu_seconds, node_name
from client import Client, GelasticError, JobSpec
from client.coordinators import (
    UNREACHABLE_HEADER,
    is_standby_answer,
    leader_hint,
    next_coordinator,
    parse_coordinators,
    reconnect_pause,
)
from client.security import Security
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

__all__ = [
    "CoordinatorProcess",
    "FleetStats",
    "RoundTimes",
    "SimFleet",
    "cpu_seconds",
    "node_name",
    "sim_job_spec",
    "wait_round_started",
]

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
STREAMS_PER_CHANNEL = 500
"""Node streams multiplexed on one HTTP/2 connection (one channel) of a fleet process."""
HEARTBEAT_SLICES = 20
"""Heartbeats of a fleet process are sent in this many evenly spaced batches per interval."""
FAKE_PORT = 29500
FAKE_PID_BASE = 1_000_000
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 5.0
"""Pauses between session attempts: random in [0, d] (full jitter), d doubling from
RECONNECT_MIN_S up to RECONNECT_MAX_S and back to RECONNECT_MIN_S after a session that lasted
over RECONNECT_RESET_S; while hunting for the leader over a list of replicas (UNAVAILABLE: a
standby that knows none, or no answer), a short pause instead, for a bounded number of passes
(`client.coordinators.reconnect_pause`): the same schedule as the node agent's
(`nodeagent/session.py`)."""
RECONNECT_RESET_S = 10.0


@dataclass
class FleetStats:
    """What the simulated nodes saw, summed over the fleet processes."""

    welcomed: int = 0
    """Sessions that got their Welcome (and are still open)."""
    ended: int = 0
    """Sessions that ended after their Welcome (the coordinator dropped a registered node)."""
    refused: int = 0
    """Session attempts the coordinator ended before its Welcome (tried again, with backoff)."""
    refused_why: dict[str, int] = field(default_factory=dict)
    """Those attempts by how they ended: the status code, and the first words of its details."""
    assigned: int = 0
    """Nodes that received an Assign for the job asked about."""
    assign_first: float | None = None
    assign_last: float | None = None
    """Wall-clock receive times (time.time()) of the first and the last of those Assigns."""
    heartbeats: int = 0
    """Heartbeats sent since the fleet started."""
    progress_reports: int = 0
    """ProgressReports sent since the fleet started."""
    welcomes: int = 0
    """Welcomes received since the fleet started (reconnects count again)."""
    welcome_last: float | None = None
    """Wall-clock receive time of the latest Welcome of any node."""
    errors: list[str] = field(default_factory=list)


class SimFleet:
    """`count` simulated nodes named sim-00000.. spread over `processes` fleet processes."""

    def __init__(
        self,
        address: str,
        count: int,
        *,
        processes: int = 2,
        slots: int = 1,
        health: bool = False,
        resume: bool = False,
        token_file: str = "",
    ) -> None:
        self.address = address
        self.token_file = token_file
        self.count = count
        self.processes = max(1, min(processes, count))
        self.slots = slots
        self.health = health
        self.resume = resume
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> SimFleet:
        per = math.ceil(self.count / self.processes)
        for first in range(0, self.count, per):
            argv = [
                PY, "-m", "bench._simnodes",
                "--address", self.address,
                "--first", str(first),
                "--count", str(min(per, self.count - first)),
                "--slots", str(self.slots),
                *(["--health"] if self.health else []),
                *(["--resume"] if self.resume else []),
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=None,
                    cwd=ROOT,
                    start_new_session=True,
                    env={**os.environ, "GELASTIC_TOKEN_FILE": self.token_file}
                    if self.token_file
                    else None,
                )
            )
        return self

    def _ask(self, command: str, timeout: float) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(command.encode() + b"\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout
        answers = []
        for p in self.procs:
            assert p.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(p.stdout, selectors.EVENT_READ)
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"fleet process {p.pid} did not answer {command!r}")
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"fleet process {p.pid} exited ({p.poll()})")
            answers.append(json.loads(line))
        return answers

    def stats(self, job_id: str = "", timeout: float = 30.0) -> FleetStats:
        out = FleetStats()
        for a in self._ask(f"stats {job_id}".strip(), timeout):
            out.welcomed += a["welcomed"]
            out.ended += a["ended"]
            out.assigned += a["assigned"]
            out.heartbeats += a["heartbeats"]
            out.progress_reports += a["progress_reports"]
            out.refused += a["refused"]
            for why, count in a["refused_why"].items():
                out.refused_why[why] = out.refused_why.get(why, 0) + count
            out.errors += a["errors"]
            out.welcomes += a["welcomes"]
            if a["welcome_last"] is not None:
                out.welcome_last = max(a["welcome_last"], out.welcome_last or 0.0)
            if a["assign_first"] is not None:
                first, last = a["assign_first"], a["assign_last"]
                out.assign_first = min(first, out.assign_first or first)
                out.assign_last = max(last, out.assign_last or last)
        return out

    def set_progress(self, hz: float, timeout: float = 30.0) -> None:
        """Every node's ranks step `hz` times a second from now, and their agents forward it
        (0: no progress reports)."""
        self._ask(f"progress {hz:g}", timeout)

    def finish(self, job_id: str, timeout: float = 30.0) -> int:
        """Every node's workers of `job_id` exit 0 now; returns how many nodes held it. A node
        without a session reports the exits in the Hello of its next one, as the agent does."""
        return sum(int(a["finished"]) for a in self._ask(f"finish {job_id}", timeout))

    def wait_welcomed(self, timeout: float) -> FleetStats:
        """Wait until every node has its Welcome; TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.welcomed >= self.count:
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{s.welcomed}/{self.count} simulated nodes registered after {timeout:g} s"
                    + (f"; errors: {s.errors[:3]}" if s.errors else "")
                )
            time.sleep(0.1)

    def psutil_procs(self) -> list[psutil.Process]:
        out = []
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                out.append(psutil.Process(p.pid))
        return out

    def stop(self, timeout: float = 15.0) -> None:
        """Ask every fleet process to close its streams and exit; SIGKILL what is left."""
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.write(b"quit\n")
                    p.stdin.flush()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        self.procs.clear()

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- a job on simulated nodes ------------------------------------------------------------------


def sim_job_spec(nodes: int, nproc_per_node: int = 1, name: str = "bench-sim") -> JobSpec:
    """A job of exactly `nodes` nodes that starts at once; simulated nodes never run it."""
    return JobSpec(
        entrypoint=["/bin/true"],
        nproc_per_node=nproc_per_node,
        min_nodes=nodes,
        max_nodes=nodes,
        last_call_timeout=0.0,
        name=name,
    )


@dataclass
class RoundTimes:
    """When the first round of a job reached the simulated nodes, in wall-clock seconds."""

    all_assigned: float | None = None
    """The last node's receive time of its Assign (None: not every node got one in time)."""
    all_started: float | None = None
    """The coordinator's timestamp of the round's `round_started` event: it has processed the
    last node's WorkersStarted."""
    assigned: int = 0
    started: int = 0


def wait_round_started(
    fleet: SimFleet, client: Client, job_id: str, timeout: float, interval: float = 0.1
) -> RoundTimes:
    """Follow a job until every node got its Assign and the coordinator recorded that every
    node's workers started (its `round_started` event), or `timeout` passes; whatever was not
    reached stays None."""
    out = RoundTimes()
    started_nodes: set[str] = set()
    round_started: float | None = None
    after = 0
    deadline = time.monotonic() + timeout
    while True:
        if out.all_assigned is None:
            s = fleet.stats(job_id)
            out.assigned = s.assigned
            if s.assigned >= fleet.count:
                out.all_assigned = s.assign_last
        if out.all_started is None:
            # Incremental reads: the coordinator keeps a bounded number of events per job.
            try:
                events = client.events(job_id, after)
            except GelasticError as exc:
                # A coordinator busy for longer than a call's deadline: just ask again.
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                events = []
            for e in events:
                after = max(after, e.seq)
                if e.kind == "workers_started" and e.node not in started_nodes:
                    started_nodes.add(e.node)
                elif e.kind == "round_started" and round_started is None:
                    round_started = e.timestamp
            out.started = len(started_nodes)
            if round_started is not None:
                # Counted from the round's own event: a round of more nodes than a job keeps
                # events has some of its `workers_started` cut before they can be read.
                out.started = fleet.count
                out.all_started = round_started
        if (out.all_assigned is not None and out.all_started is not None) or (
            time.monotonic() > deadline
        ):
            return out
        time.sleep(interval)


# ---- the fleet process ------------------------------------------------------------------------


@dataclass
class _Held:
    job_id: str
    round: int
    attempt: int
    workers: list[pb.WorkerPid]
    exits: list[pb.WorkerExit] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)


PROGRESS_EVERY_S = 0.5
"""How often a node forwards its workers' progress (the agent's FORWARD_EVERY_S)."""


class _SimNode:
    """One simulated agent: a NodeSession stream, a reader and a writer task."""

    def __init__(
        self, fleet: _FleetProcess, index: int, stub: pb_grpc.NodeSessionStub | None
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.name = node_name(index)
        self.stub = stub
        """The shared channel's stub; None: a channel of its own per session attempt."""
        self.outbox: asyncio.Queue[pb.NodeMessage] = asyncio.Queue()
        self.welcomed = False
        self.welcomes = 0
        self.welcome_at: float | None = None
        self.ended = 0
        self.held: dict[tuple[str, int], _Held] = {}
        self.assigned_at: dict[str, float] = {}
        self.seq = 0
        self.target = fleet.addresses[0]
        """The replica the current (or next) session dials."""
        self.epoch = 0
        """The newest leader epoch seen; a message with an older one ends the session."""
        self.hint = ""
        """The listed leader the last session's standby named ("" when none)."""
        self.unavailable = False
        """The last session attempt ended UNAVAILABLE (no leader there, or no answer)."""
        self.gone = ""
        """The listed replica a session could not reach, until one is welcomed (as the agent
        tells the others in `UNREACHABLE_HEADER`)."""
        self.in_hello: set[tuple[str, int, int]] = set()
        """(job, round, local rank) of the exits the current session's Hello carried."""
        self.ended_why = "OK"
        """How the last session attempt ended (a status code and its details' first words)."""

    async def run(self) -> None:
        """Keep a session open, reconnecting with backoff and full jitter like the real agent."""
        delay = RECONNECT_MIN_S
        incarnation = uuid.uuid4().hex
        listed = self.fleet.addresses
        hops = 0
        hunting = 0  # attempts since the last welcome that found no leader
        while True:
            started = time.monotonic()
            target = self.target
            self.hint = ""
            self.unavailable = False
            if self.stub is not None:
                welcomed = await self._session(self.stub, incarnation)
            else:
                async with grpc.aio.insecure_channel(
                    target, options=[("grpc.use_local_subchannel_pool", 1)]
                ) as channel:
                    welcomed = await self._session(pb_grpc.NodeSessionStub(channel), incarnation)
            if not welcomed:
                # The server ended the attempt before its Welcome: a busy coordinator turns new
                # calls away (too many pending calls), a standby points at the leader, or none
                # listens; the agent tries again.
                self.fleet.refused += 1
                why = self.ended_why
                self.fleet.refused_why[why] = self.fleet.refused_why.get(why, 0) + 1
            else:
                hunting = 0
            self.target = next_coordinator(listed, target, {target}) or target
            if self.hint and self.hint != target and hops < len(listed):
                self.target = self.hint  # straight to the leader the standby named
                hops += 1
                continue
            hops = 0
            if time.monotonic() - started > RECONNECT_RESET_S:
                delay = RECONNECT_MIN_S
            hunted = self.unavailable
            hunting = hunting + 1 if hunted else hunting
            low, high = reconnect_pause(delay, hunting if hunted else 0, len(listed))
            await asyncio.sleep(random.uniform(low, high))
            if low == 0:
                delay = min(delay * 2, RECONNECT_MAX_S)

    def _running(self) -> list[pb.RunningGroup]:
        """What this node holds, as the real agent reports it in the Hello after a reconnect."""
        return [
            pb.RunningGroup(
                job_id=h.job_id, round=h.round, attempt=h.attempt, workers=h.workers, exits=h.exits
            )
            for h in self.held.values()
        ]

    def finish(self, job_id: str) -> bool:
        """Its workers of `job_id` exit 0: sent now when in a session, and kept for the Hello."""
        held = [h for h in self.held.values() if h.job_id == job_id and not h.exits]
        for h in held:
            for w in h.workers:
                exit_ = pb.WorkerExit(
                    local_rank=w.local_rank,
                    global_rank=w.global_rank,
                    pid=w.pid,
                    exitcode=0,
                    timestamp=time.time(),
                )
                h.exits.append(exit_)
                if self.welcomed:
                    self.send(
                        pb.NodeMessage(
                            worker_exited=pb.WorkerExited(
                                job_id=h.job_id, round=h.round, exit=exit_
                            )
                        )
                    )
        return bool(held)

    async def _session(self, stub: pb_grpc.NodeSessionStub, incarnation: str) -> bool:
        """One session attempt; True if the coordinator welcomed this node."""
        self.outbox = asyncio.Queue()
        self.in_hello = {
            (h.job_id, h.round, e.local_rank) for h in self.held.values() for e in h.exits
        }
        self.send(
            pb.NodeMessage(
                hello=pb.Hello(
                    name=self.name,
                    addr="127.0.0.1",
                    slots=self.fleet.slots,
                    incarnation=incarnation,
                    version="sim",
                    running=self._running() if self.fleet.resume else [],
                )
            )
        )
        metadata = self.fleet.metadata
        if self.gone and self.gone != self.target:
            metadata += ((UNREACHABLE_HEADER, self.gone),)
        call = stub.Session(metadata=metadata)
        writer = asyncio.get_running_loop().create_task(self._write(call))
        welcomed = False
        self.ended_why = "OK"
        try:
            async for msg in call:
                if msg.epoch < self.epoch:
                    self.fleet.stale += 1  # a deposed leader: hang up, act on nothing of it
                    break
                self.epoch = msg.epoch
                self._on(msg)
                welcomed = welcomed or self.welcomed
        except grpc.aio.AioRpcError as exc:
            self.ended_why = f"{exc.code().name}: {(exc.details() or '')[:40]}"
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.unavailable = True
                self.hint = leader_hint(exc.trailing_metadata(), self.fleet.addresses)
                standby = is_standby_answer(exc.details() or "", bool(self.hint))
                if self.fleet.replicas and not standby:
                    self.gone = self.target
            if welcomed and not self.fleet.replicas:
                self.fleet.error(f"{self.name}: session ended: {exc.code().name}: {exc.details()}")
        finally:
            if welcomed:
                self.ended += 1
            self.welcomed = False
            if not self.fleet.resume:
                self.held.clear()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            call.cancel()
        return welcomed

    async def _write(self, call: Any) -> None:
        # One write at a time on a call; a failed write means the stream is over, which the
        # reader sees as well (a refused attempt surfaces here as an "internal error").
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                await call.write(await self.outbox.get())

    def send(self, msg: pb.NodeMessage) -> None:
        self.outbox.put_nowait(msg)

    def heartbeat(self) -> None:
        self.seq += 1
        groups = []
        if self.fleet.health:
            groups = [
                pb.GroupHealth(
                    job_id=h.job_id,
                    round=h.round,
                    workers=[
                        pb.WorkerHealth(
                            local_rank=w.local_rank,
                            global_rank=w.global_rank,
                            pid=w.pid,
                            cpu_percent=97.0,
                            rss_bytes=512 * 1024 * 1024,
                            proc_state="running",
                        )
                        for w in h.workers
                    ],
                )
                for h in self.held.values()
            ]
        self.send(pb.NodeMessage(heartbeat=pb.Heartbeat(seq=self.seq, groups=groups)))

    def progress(self, hz: float) -> int:
        """One ProgressReport per held round: every rank stepping `hz` times a second."""
        sent = 0
        for h in self.held.values():
            step = int((time.monotonic() - h.started_at) * hz)
            ranks = [
                pb.RankProgress(
                    local_rank=w.local_rank,
                    global_rank=w.global_rank,
                    step=step,
                    steps_per_s=hz,
                    metrics={"loss": 1.0 / (step + 1)},
                )
                for w in h.workers
            ]
            report = pb.ProgressReport(job_id=h.job_id, round=h.round, ranks=ranks)
            self.send(pb.NodeMessage(progress_report=report))
            sent += 1
        return sent

    def _on(self, msg: pb.CoordinatorMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "welcome":
            self.welcomed = True
            self.gone = ""
            # Exits since the Hello was made (a session a standby held): sent now, as the
            # agent replays what it holds after the welcome.
            for h in self.held.values():
                for e in h.exits:
                    if (h.job_id, h.round, e.local_rank) not in self.in_hello:
                        exited = pb.WorkerExited(job_id=h.job_id, round=h.round, exit=e)
                        self.send(pb.NodeMessage(worker_exited=exited))
            self.welcomes += 1
            self.welcome_at = time.time()
            self.fleet.heartbeat_interval = max(0.05, msg.welcome.heartbeat_interval_ms / 1000)
        elif kind == "reserve_port":
            m = msg.reserve_port
            self.send(
                pb.NodeMessage(
                    port_reserved=pb.PortReserved(job_id=m.job_id, round=m.round, port=FAKE_PORT)
                )
            )
        elif kind == "assign":
            a = msg.assign
            self.assigned_at.setdefault(a.job_id, time.time())
            workers = [
                pb.WorkerPid(
                    local_rank=w.local_rank,
                    pid=FAKE_PID_BASE + self.index * 64 + w.local_rank,
                    global_rank=w.global_rank,
                )
                for w in a.workers
            ]
            self.held[(a.job_id, a.round)] = _Held(a.job_id, a.round, a.attempt, workers)
            started = pb.WorkersStarted(job_id=a.job_id, round=a.round, workers=workers)
            self.send(pb.NodeMessage(workers_started=started))
        elif kind == "stop":
            stop = msg.stop
            self.held.pop((stop.job_id, stop.round), None)
            stopped = pb.GroupStopped(job_id=stop.job_id, round=stop.round)
            self.send(pb.NodeMessage(group_stopped=stopped))
        elif kind == "release":
            self.held.pop((msg.release.job_id, msg.release.round), None)
        elif kind == "start_logs":
            self.send(
                pb.NodeMessage(
                    log_chunk=pb.LogChunk(
                        request_id=msg.start_logs.request_id,
                        eof=True,
                        error="a simulated node keeps no logs",
                    )
                )
            )


class _FleetProcess:
    """The simulated nodes of one process and the commands it answers on stdin."""

    def __init__(
        self, address: str, first: int, count: int, slots: int, health: bool, resume: bool = False
    ) -> None:
        self.address = address
        self.addresses = parse_coordinators(address)
        self.replicas = len(self.addresses) > 1
        """A list of replicas: a session ending is a failover, not an error."""
        if self.replicas and not resume:
            raise ValueError("a list of coordinators needs --resume (a channel per session)")
        self.first = first
        self.count = count
        self.slots = slots
        self.health = health
        self.resume = resume
        self.stale = 0
        """Sessions ended on a message of an older leader epoch."""
        self.heartbeat_interval = 1.0
        self.nodes: list[_SimNode] = []
        self.errors: list[str] = []
        self.heartbeats = 0
        self.progress_hz = 0.0
        self.progress_reports = 0
        self.refused = 0
        self.refused_why: dict[str, int] = {}
        self.metadata = Security.from_env().metadata
        """The agent token of $GELASTIC_TOKEN_FILE, if the coordinator wants one."""

    def error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        channels = (
            []
            if self.resume  # every node opens a channel of its own per session attempt
            else [
                grpc.aio.insecure_channel(
                    self.address,
                    # A subchannel of its own per channel: one HTTP/2 connection each.
                    options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
                )
                for i in range(math.ceil(self.count / STREAMS_PER_CHANNEL))
            ]
        )
        stubs = [pb_grpc.NodeSessionStub(c) for c in channels]
        self.nodes = [
            _SimNode(self, self.first + i, stubs[i // STREAMS_PER_CHANNEL] if stubs else None)
            for i in range(self.count)
        ]
        tasks = [loop.create_task(n.run()) for n in self.nodes]
        ticker = loop.create_task(self._heartbeats())
        forwarder = loop.create_task(self._progress())
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while True:
                line = (await reader.readline()).decode().strip()
                if not line or line == "quit":
                    break
                cmd, _, arg = line.partition(" ")
                if cmd == "stats":
                    self._answer(self._stats(arg))
                elif cmd == "progress":
                    self.progress_hz = max(0.0, float(arg))
                    self._answer({"progress_hz": self.progress_hz})
                elif cmd == "finish":
                    self._answer({"finished": sum(n.finish(arg) for n in self.nodes)})
                else:
                    self._answer({"error": f"unknown command {cmd!r}"})
        finally:
            ticker.cancel()
            forwarder.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(ticker, forwarder, *tasks, return_exceptions=True)
            for c in channels:
                await c.close(grace=None)

    async def _heartbeats(self) -> None:
        """Every node heartbeats once per interval, the fleet's nodes spread evenly over it."""
        slice_no = 0
        next_at = time.monotonic()
        while True:
            next_at += self.heartbeat_interval / HEARTBEAT_SLICES
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            for n in self.nodes[slice_no::HEARTBEAT_SLICES]:
                if n.welcomed:
                    n.heartbeat()
                    self.heartbeats += 1
            slice_no = (slice_no + 1) % HEARTBEAT_SLICES

    async def _progress(self) -> None:
        """With a progress rate, every node forwards progress each PROGRESS_EVERY_S, spread."""
        slice_no = 0
        next_at = time.monotonic()
        while True:
            next_at += PROGRESS_EVERY_S / HEARTBEAT_SLICES
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if self.progress_hz > 0:
                for n in self.nodes[slice_no::HEARTBEAT_SLICES]:
                    if n.welcomed:
                        self.progress_reports += n.progress(self.progress_hz)
            slice_no = (slice_no + 1) % HEARTBEAT_SLICES

    def _stats(self, job_id: str) -> dict[str, Any]:
        times = [n.assigned_at[job_id] for n in self.nodes if job_id in n.assigned_at]
        welcome_times = [n.welcome_at for n in self.nodes if n.welcome_at is not None]
        return {
            "welcomes": sum(n.welcomes for n in self.nodes),
            "welcome_last": max(welcome_times) if welcome_times else None,
            "welcomed": sum(n.welcomed for n in self.nodes),
            "ended": sum(n.ended for n in self.nodes),
            "assigned": len(times),
            "assign_first": min(times) if times else None,
            "assign_last": max(times) if times else None,
            "heartbeats": self.heartbeats,
            "progress_reports": self.progress_reports,
            "refused": self.refused,
            "refused_why": self.refused_why,
            "stale": self.stale,
            "errors": self.errors,
        }

    @staticmethod
    def _answer(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._simnodes", description=__doc__)
    p.add_argument(
        "--address", required=True, help="the coordinator, host:port (or a list of replicas)"
    )
    p.add_argument("--first", type=int, default=0, help="index of this process's first node")
    p.add_argument("--count", type=int, required=True, help="nodes in this process")
    p.add_argument("--slots", type=int, default=1, help="slots each node offers")
    p.add_argument("--health", action="store_true", help="send worker health in heartbeats")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep held rounds across sessions and report them in Hello; a channel per session",
    )
    args = p.parse_args(argv)
    fleet = _FleetProcess(
        args.address, args.first, args.count, args.slots, args.health, args.resume
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fleet.main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
