"""The coordinator's service: the `Cluster` state machine, and what carries out its effects.

Everything runs on one asyncio loop, so the state machine is called one event at a time without
locks. Each input to the state machine returns a `Ready`, its effects split as a raft node's
are: the changes go to the service's journal (coordinator._journal), which writes them and holds
back what must wait for the write; the messages go to the node sessions; the job watchers are
woken.
Around it sit the client RPCs (coordinator._rpc), the node agents' streams
(coordinator._node_sessions), whose heartbeats are taken in batches
(coordinator._heartbeat_batch), the log relay (coordinator._log_relay) and the stack captures
(coordinator._stacks).

The names imported here as themselves (`from m import X as X`) stay importable from this module
for whoever took them from here; they live in their own modules, and are patched there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Collection

import grpc

from client.model import (
    JobSpec,
    SpecError,
)
from client.node_codec import MessageError, decode_node, encode_coordinator
from client.node_protocol import (
    ClockProbe,
    Heartbeat,
    Hello,
    LogChunk,
    StackReply,
    Welcome,
)
from client.spec_diff import spec_differences
from client.stacks import StackCapture
from client.wire import (
    check_spec_size,
    job_to_pb,
)
from coordinator._auth import RefusalLog
from coordinator._cluster import (
    AssignRound,
    CloseSession,
    Cluster,
    ClusterConfig,
    DrainAccepted,
    Effect,
    EventRecorded,
    Forgotten,
    JobChanged,
    Ready,
    ReleaseRound,
    RequestPort,
    StallDetected,
    StopRound,
)
from coordinator._errors import RequestError
from coordinator._heartbeat_batch import HeartbeatBatch
from coordinator._job_messages import _bounded_job
from coordinator._journal import Journal
from coordinator._log_relay import LOG_CHUNK_MAX_BYTES as LOG_CHUNK_MAX_BYTES
from coordinator._log_relay import LOG_STREAMS_MAX as LOG_STREAMS_MAX
from coordinator._log_relay import LOG_STREAMS_PER_CLIENT as LOG_STREAMS_PER_CLIENT
from coordinator._log_relay import LOG_WINDOW_CHUNKS as LOG_WINDOW_CHUNKS
from coordinator._log_relay import LogRelay
from coordinator._node_claims import secret_digest
from coordinator._node_sessions import MAX_NODE_MESSAGE_BYTES as MAX_NODE_MESSAGE_BYTES
from coordinator._node_sessions import OUTBOX_LIMIT as OUTBOX_LIMIT
from coordinator._node_sessions import _assign_size_bound as _assign_size_bound
from coordinator._node_sessions import (
    _check_hello,
    _command,
    _NodeSessionServicer,
    _Session,
    _undeliverable,
)
from coordinator._rpc import ATTEMPTS_PAGE_MAX as ATTEMPTS_PAGE_MAX
from coordinator._rpc import _attempt_page as _attempt_page
from coordinator._rpc import _CoordinatorServicer
from coordinator._stacks import CAPTURE_WAIT_S, StackCollector
from coordinator._store import StateStore, StoreFenced
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

__all__ = ["CoordinatorService"]

logger = logging.getLogger(__name__)

TICK_S = 0.1
RECONNECT_GRACE_S = 15.0
REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class CoordinatorService:
    """Owns the cluster state, its journal, the node sessions, the log relay, the job watchers
    and the tick loop."""

    def __init__(
        self,
        config: ClusterConfig | None = None,
        clock: Callable[[], float] = time.time,
        store: StateStore | None = None,
        reconnect_grace: float = RECONNECT_GRACE_S,
    ) -> None:
        self.cluster = Cluster(config)
        self.config = self.cluster.config
        self._clock = clock
        self._job_versions: dict[str, int] = {}
        self._store = store
        self._reconnect_grace = reconnect_grace
        self.refusals = RefusalLog()
        """Refused agents and clients, logged at WARNING at a bounded rate."""
        self._notify_pending = False
        self._notify_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._restore_effects: list[Effect] = []
        self._stopping = False
        self.journal = Journal(store, self.cluster, self._fenced)
        """What is not on disk yet, and what waits for it (messages to agents, readers)."""
        if store is not None:
            self._restore_effects = self.journal.restore(clock, reconnect_grace)
            for job_id in self.cluster.job_ids():
                self._job_versions[job_id] = 0
        self._sessions: dict[str, _Session] = {}
        self._changed = asyncio.Condition()
        self.log_relay = LogRelay(self.cluster, self._sessions)
        self.stacks = StackCollector(self.cluster, self._sessions, self.apply, self.now)
        self._tick_task: asyncio.Task[None] | None = None
        self.coordinator_id = uuid.uuid4().hex
        self.effect_observers: list[Callable[[list[Effect]], None]] = []  # e.g. metrics
        self.heartbeat_observers: list[Callable[[Heartbeat], None]] = []  # e.g. torch metrics
        self.require_cert_node_names = False
        """With mTLS: refuse a session whose node name is not in the agent's certificate."""
        self.dashboard: tuple[str, str, int] | None = None
        """(scheme, host, port) of the web dashboard while it serves (GetDashboard)."""
        self.epoch = 0
        """The leader's epoch, carried by every message to the agents (0: one coordinator)."""
        self.may_send: Callable[[], bool] = _always
        """Checked before every message a node session writes: False once this coordinator
        no longer leads (the session then closes, and nothing more is sent)."""
        self.on_fenced: Callable[[str], None] | None = None
        """Called when the store refused a write because another coordinator leads."""
        self._beats = HeartbeatBatch(
            lambda batch: self.apply(self.cluster.heartbeats(batch, self.now())),
            self._after_heartbeat,
        )

    @property
    def reconnect_grace(self) -> float:
        """After a restart, seconds a known node has to reconnect before it counts as lost."""
        return self._reconnect_grace

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._tick_task is None:
            loop = asyncio.get_running_loop()
            self._tick_task = loop.create_task(self._tick_loop(), name="tick")
            if self._store is not None:
                self._flush_task = loop.create_task(self.journal.flush_loop(), name="flush")
            effects, self._restore_effects = self._restore_effects, []
            self.apply(effects)

    async def stop(self) -> None:
        # The sessions end because this process stops, not because their nodes went away:
        # nobody is told those nodes were lost (a restart gives them the reconnect grace).
        self._stopping = True
        await self._end_tasks()
        for s in list(self._sessions.values()):
            s.close()
        # Fenced: another coordinator leads (this one had not noticed yet), so what was not
        # written is not this one's to write; flush logged it.
        with contextlib.suppress(StoreFenced):
            await self.flush()

    async def abandon(self) -> None:
        """Stop at once without writing anything: another coordinator leads now. The node
        sessions close; what was not written is dropped with the rest of this state."""
        self._stopping = True
        self.may_send = _never
        await self._end_tasks()
        self.journal.drop_held()
        for s in list(self._sessions.values()):
            s.close()

    async def _end_tasks(self) -> None:
        self._beats.clear()
        for task in (self._tick_task, self._flush_task, *self.stacks.stall_captures):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tick_task = self._flush_task = None

    # ---- persistence -----------------------------------------------------------------------

    async def flush(self) -> None:
        """Write every change made so far; returns once it is on disk (see Journal.flush)."""
        await self.journal.flush()

    async def written(self, job_ids: Collection[str] | None = None) -> None:
        """Return once the named jobs (every job: None) have no change that is not on disk.

        A client must never see a state, a result or an event that a crash could take back.
        """
        await self.journal.written(job_ids)

    def _fenced(self, why: str) -> None:
        if self.on_fenced is not None:
            self.on_fenced(why)

    def add_to_server(
        self, server: grpc.aio.Server, current: Callable[[], CoordinatorService] | None = None
    ) -> None:
        """Serve this service; with `current`, whichever service it returns at each call (a
        replica's service changes with each term it leads)."""
        get = current or (lambda: self)
        pb_grpc.add_CoordinatorServicer_to_server(_CoordinatorServicer(get), server)
        pb_grpc.add_NodeSessionServicer_to_server(_NodeSessionServicer(get), server)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.take_heartbeats()  # a lease is judged on every beat already read
                self.apply(self.cluster.tick(self._clock()))
            except Exception:
                logger.exception("tick failed")

    # ---- effects ---------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def apply(self, effects: list[Effect]) -> None:
        for observe in self.effect_observers:
            observe(effects)
        ready = effects if isinstance(effects, Ready) else Ready(effects)
        persist = ready.persist  # made on each read: once per batch on this hot path
        changed = False
        for change in persist:  # the watchers' versions
            if isinstance(change, JobChanged):
                self._job_versions[change.job_id] = self._job_versions.get(change.job_id, 0) + 1
                changed = True
            elif isinstance(change, EventRecorded):
                changed = True
            elif isinstance(change, Forgotten) and change.job_id:
                self._job_versions.pop(change.job_id, None)
        # The state first: a message below must see every change it follows as unwritten.
        self.journal.record(persist)
        for eff in effects:
            if isinstance(eff, StallDetected) and not self._stopping:
                self.stacks.after_stall(eff)
        for eff in ready.send:
            if isinstance(eff, CloseSession):
                s = self._sessions.get(eff.node)
                if s is not None and s.incarnation == eff.incarnation:
                    logger.warning("closing the session of node %s: %s", eff.node, eff.reason)
                    s.close()
            else:
                self._send(eff)
        if changed and not self._notify_pending:
            # One wake-up per burst of changes, not one task per node message.
            self._notify_pending = True
            self._notify_task = asyncio.get_running_loop().create_task(self._notify())
        if self.journal.wants_flush():
            self.journal.flush_wanted.set()

    async def _notify(self) -> None:
        self._notify_pending = False
        async with self._changed:
            self._changed.notify_all()

    def _send(
        self, eff: RequestPort | AssignRound | StopRound | ReleaseRound | DrainAccepted
    ) -> None:
        s = self._sessions.get(eff.node)
        if isinstance(eff, DrainAccepted) and s is not None and s.incarnation != eff.incarnation:
            return  # the agent that asked is gone
        if s is None:
            logger.info("node %s has no session; dropping %s", eff.node, type(eff).__name__)
            return
        msg = encode_coordinator(_command(eff))
        if isinstance(eff, AssignRound) and (why := _undeliverable(eff, msg)):
            # After the effects being applied now, so none of them follows the stop it causes.
            asyncio.get_running_loop().call_soon(
                self._assign_undeliverable,
                eff.node,
                eff.assignment.job_id,
                eff.assignment.round,
                why,
            )
            return
        self.journal.send_after_write(s, msg)

    def _assign_undeliverable(self, node: str, job_id: str, round_: int, why: str) -> None:
        if self.cluster.has_job(job_id):
            self.apply(self.cluster.assign_undeliverable(node, job_id, round_, why, self.now()))

    async def wait_changed(self, job_id: str, seen_version: int, timeout: float) -> int:
        """Wait until the job's version moves past `seen_version` (or timeout); return it."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: self._job_versions.get(job_id, 0) != seen_version
                    ),
                    timeout,
                )
        return self._job_versions.get(job_id, 0)

    def watch_interval(self, job_id: str) -> float:
        """Pause between two watch updates: none for small jobs, up to 0.5 s for huge ones."""
        spec = self.cluster.job_spec(job_id)
        return min(0.5, spec.nproc_per_node * spec.max_nodes / 20_000)

    def job_version(self, job_id: str) -> int:
        return self._job_versions.get(job_id, 0)

    def job_message(self, job_id: str, *, with_spec: bool = False) -> pb.Job:
        c = self.cluster
        return _bounded_job(
            job_to_pb(
                c.job_status(job_id),
                c.job_result(job_id),
                c.job_spec(job_id) if with_spec else None,
            )
        )

    # ---- submit ----------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, request_id: str = "") -> str:
        """Queue a validated spec; return its job id once the job is on disk.

        A repeated `request_id` (a client retrying after a timeout) returns the job the first
        try made. When the write fails the job is withdrawn before anything of it ran, and the
        client hears UNAVAILABLE: a retry with the same id submits it again.
        """
        check_spec_size(spec)
        if request_id and not REQUEST_ID.fullmatch(request_id):
            raise SpecError(
                "request_id", f"must be 1-128 of [A-Za-z0-9_.-], got {request_id[:80]!r}"
            )
        c = self.cluster
        earlier = c.job_for_request(request_id) if request_id else None
        if earlier is not None:
            first = c.job_spec(earlier)
            if first != spec:
                raise SpecError(
                    "request_id",
                    f"already used to submit a different spec ({earlier}): "
                    + "; ".join(spec_differences(spec, first)),
                )
            await self.written([earlier])
            return earlier
        job_id = _new_job_id(spec.name)
        store = self._store
        self.apply(
            c.submit(
                job_id, spec, self.now(), request_id=request_id, awaiting_write=store is not None
            )
        )
        if store is None:
            return job_id
        try:
            await self.flush()
            await self.written([job_id])
        except Exception as exc:
            if c.has_job(job_id) and self.journal.is_unwritten(job_id):
                c.withdraw(job_id)
                # A write whose outcome is unknown (etcd: no answer in time) may have landed:
                # the next write deletes the job, so a restart cannot bring it back.
                self.journal.discard(job_id)
                self._job_versions.pop(job_id, None)
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the coordinator could not write the job to its store; it was not queued: "
                    f"{str(exc)[:300]}",
                ) from exc
            raise
        self.apply(c.confirm_written(job_id, self.now()))
        return job_id

    # ---- node sessions ---------------------------------------------------------------------

    def open_session(self, hello: Hello) -> _Session:
        _check_hello(hello)
        # A second session is refused while one is open under the name, unless the agent proves
        # with its node secret that it is that node (the old one is then a dead process's
        # stream: it ends here). An unproven agent gets in once the old stream has ended (or
        # its lease expired).
        old = self._sessions.get(hello.name)
        effects = self.cluster.node_connected(
            hello.name,
            hello.addr,
            hello.slots,
            hello.incarnation,
            self.now(),
            list(hello.running),
            list(hello.gpus),
            secret_digest=secret_digest(hello.node_secret),
            session_open=old is not None,
        )
        if old is not None:
            logger.warning(
                "node %s: a new session of its agent replaces the one still open", hello.name
            )
            del self._sessions[hello.name]
            old.close()
        session = _Session(hello.name, hello.incarnation)
        self._sessions[hello.name] = session
        self.journal.node_changed(hello.name)
        session.send(
            encode_coordinator(
                Welcome(self.config.heartbeat_interval, self.config.lease, self.coordinator_id)
            )
        )
        self._probe_clock(session)
        self.apply(effects)
        return session

    def close_session(self, session: _Session) -> None:
        session.close()
        if self._sessions.get(session.name) is session:
            del self._sessions[session.name]
            self.journal.node_changed(session.name)
            if self._stopping:
                return
            self.apply(
                self.cluster.node_disconnected(session.name, session.incarnation, self.now())
            )

    def on_heartbeat(self, session: _Session, msg: pb.NodeMessage) -> None:
        """A heartbeat read from `session`: taken with the others of the next batch."""
        self._beats.add(session, msg)

    def take_heartbeats(self) -> None:
        """Take every heartbeat read and not taken yet, as one input to the state machine."""
        self._beats.take()

    def _after_heartbeat(self, session: _Session, beat: Heartbeat) -> None:
        self._probe_clock(session)
        for observe in self.heartbeat_observers:
            observe(beat)

    def on_node_message(self, session: _Session, msg: pb.NodeMessage) -> None:
        if self._beats.holds(session.name):
            self.take_heartbeats()  # in the order the node sent them
        try:
            decoded = decode_node(msg)
        except MessageError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if isinstance(decoded, Hello):
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, "hello sent twice on one session"
            )
        if isinstance(decoded, LogChunk):
            self.log_relay.on_chunk(session, decoded)
        elif isinstance(decoded, StackReply):
            self.stacks.on_reply(session, decoded)
        self.apply(self.cluster.step(session.name, session.incarnation, decoded, self.now()))
        if isinstance(decoded, Heartbeat):
            self._after_heartbeat(session, decoded)

    def _probe_clock(self, session: _Session) -> None:
        """Probe the node's clock when the cluster says it is time. Straight to the session:
        a probe changes nothing stored, so it waits for no write (a wait would only widen the
        round trip it measures)."""
        now = self.now()
        # Busy while state changes wait for the write: a round forming, its nodes reporting.
        busy = self.journal.wants_flush()
        if self.cluster.clock_probe_due(session.name, session.incarnation, now, busy):
            session.send(encode_coordinator(ClockProbe(now)))

    # ---- stacks ----------------------------------------------------------------------------

    async def capture_stacks(
        self,
        job_id: str,
        reason: str,
        *,
        rank: int | None = None,
        native: bool = False,
        wait: float = CAPTURE_WAIT_S,
    ) -> StackCapture:
        """Every running rank's stack of the job, read by the agents that run them, grouped and
        kept with the job (an event of kind "stacks" names it); returns once it is written.
        What any part of the coordinator calls to look at a job's ranks (see StackCollector)."""
        capture = await self.stacks.capture(job_id, reason, rank=rank, native=native, wait=wait)
        await self.flush()
        await self.written([job_id])
        return capture


def _always() -> bool:
    return True


def _never() -> bool:
    return False


def _new_job_id(name: str) -> str:
    prefix = name[:40] if name else "job"
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
