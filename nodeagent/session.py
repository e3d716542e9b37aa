"""The node agent's session with the coordinator: one bidirectional gRPC stream.

The agent registers (hello), heartbeats with its workers' health, and carries out what it is
told: reserve a master port, start a round's workers, stop them, serve their logs. It pushes
every worker start and exit the moment it happens. When the stream breaks it keeps its workers
running, reconnects with backoff and jitter, and re-reports everything it holds (including exits
that happened meanwhile), so nothing is lost while the coordinator is away. Given a list of
coordinator replicas it rotates through them, going straight to the leader a standby names when
that address is listed. It keeps the newest leader epoch it has seen and refuses (and hangs up
on) a coordinator that speaks with an older one. A refusal no retry
can fix (a wrong token, a name another live agent holds, a TLS setting the coordinator does not
accept) ends the session loop instead, with the reason in `refusal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from client.assignment import RoundAssignment
from client.coordinators import (
    UNREACHABLE_HEADER,
    is_standby_answer,
    leader_hint,
    next_coordinator,
    parse_coordinators,
    reconnect_pause,
)
from client.model import (
    MAX_STANDBY_LINGER_S,
    FailureCategory,
    ProcessFailure,
    is_job_id,
    is_name,
)
from client.node_codec import MessageError, decode_coordinator, encode_node
from client.node_protocol import (
    Assign,
    CancelLogs,
    CoordinatorMsg,
    GroupHealth,
    GroupStopped,
    GroupUnknown,
    Heartbeat,
    Hello,
    LogChunk,
    LogCredit,
    NodeMsg,
    PortReserved,
    Release,
    ReservePort,
    RunningGroup,
    StartLogs,
    Stop,
    Welcome,
    WorkerExited,
    WorkerFailing,
    WorkerHealthSample,
    WorkersStarted,
)
from client.node_protocol import WorkerExit as ReportedExit
from client.security import Security
from nodeagent._dirs import default_agent_dir, fresh_agent_dir, private_dir
from nodeagent._gpus import (
    FAULT_FILE_ENV,
    GpuDevice,
    GpuHealth,
    GpuMonitor,
    discover_gpus,
    load_nvml,
    parse_gpus,
)
from nodeagent._launch import attempt_dirs, role_spec
from nodeagent._metrics import AgentMetrics
from nodeagent._process import Sentinel
from nodeagent._reaper import PidRegistry, reap_previous
from nodeagent._standby import StandbyPool, can_serve
from nodeagent._workers import WorkerExit, WorkerGroup
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

__all__ = ["AgentConfig", "NodeAgent", "StaleEpoch"]

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
LOG_CHUNK_BYTES = 64 * 1024
LOG_OUTBOX_CHUNKS = 8
"""Log chunks queued for the stream at once, all log requests together: a reader of a log file
waits for room here (and for the coordinator's credit), so logs never grow the outbox."""
LOG_REQUESTS_MAX = 64
"""Log requests served at once; more are answered with an error."""
LOG_CREDIT_MAX = 1024
"""Most chunks of credit one log request holds."""
CONTROL_OUTBOX_LIMIT = 10_000
"""Control messages (heartbeats, starts, exits) queued for a stream that is not draining; past
this the session is dropped and a new one re-reports everything the agent holds."""
REFUSED_RETRY_MAX_S = 1.0
"""Longest pause between tries while the coordinator still holds this node's previous session."""
NAME_HELD_HEADER = "gelastic-name-held-ms"
"""Trailing metadata of a name-in-use refusal: how long the name can stay held by an agent that
is in fact gone (its lease, or the reconnect grace after a restart)."""
NAME_HELD_DEFAULT_S = 60.0
"""How long refusals of a name in use are retried when the coordinator does not say."""
NAME_HELD_MARGIN_S = 3.0
PROBE_CONFIRM_S = 0.5
"""A TLS verdict ends the agent only when a second probe this much later agrees."""
RETRY_LOG_EVERY_S = 10.0
"""A retry with the same reason and pause is logged again after this long."""
STALE_LOG_EVERY_S = 10.0
"""Refusals of messages from an older leader epoch are logged at most this often."""
_PROBE_HINTS = (
    "socket closed",
    "handshake",
    "ssl",
    "tls",
    "verification",
    "connection reset",
    "end of tcp",
)
"""An UNAVAILABLE whose details say one of these may be a TLS mismatch grpc does not name."""


_WAKE = pb.NodeMessage()
"""Put into the control outbox (by identity, never sent) when a log chunk waits to be sent."""


@dataclass(frozen=True)
class AgentConfig:
    """How a node agent joins its coordinator. CLI flags map one-to-one onto fields."""

    coordinator: str
    """host:port of the coordinator, or a comma-separated list of its replicas (at most 16)."""
    slots: int = 0
    """Worker processes this node may run at once (0 = one per offered GPU, or the CPU count
    on a node that offers none)."""
    gpus: str = "auto"
    """GPUs to offer: "auto" (every GPU NVML sees; none without nvidia-ml-py or a driver),
    "none", or NVML indices such as "0,1,2,3"."""
    name: str = field(default_factory=socket.gethostname)
    """Unique node name."""
    addr: str = ""
    """Address peers use to reach this node (MASTER_ADDR); "" = the one that routes to the coordinator."""
    log_dir: str = ""
    """Where worker logs go ("" = `$XDG_STATE_HOME/gelastic/agent-<name>/logs`, for root
    `/var/lib/gelastic/agent-<name>/logs`). It must be ours and not group/world-writable."""
    state_dir: str = ""
    """Where the agent keeps its worker pid file ("" = log_dir)."""
    reconnect_max: float = 5.0
    """Longest pause between reconnect attempts, in seconds."""
    token_file: str = ""
    """File holding the token the coordinator expects from agents."""
    tls_ca: str = ""
    """PEM CA of the coordinator's certificate ("" = plain text)."""
    tls_cert: str = ""
    """PEM client certificate for mTLS."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_server_name: str = ""
    """Name to check in the coordinator's certificate, when it differs from the host."""
    tls: bool = False
    """Use TLS without tls_ca: verify the coordinator against the system trust store."""
    insecure: bool = False
    """Allow sending the agent token in plain text to a coordinator off this host."""
    metrics_port: int = 0
    """Port to serve Prometheus metrics on over HTTP (0 = no metrics)."""
    metrics_host: str = "127.0.0.1"
    """Address to serve the metrics on."""

    def validate(self) -> None:
        if not 0 <= self.slots <= 4096:
            raise ValueError(f"slots: must be 1-4096 (0: the default), got {self.slots}")
        parse_gpus(self.gpus)
        if not is_name(self.name):
            raise ValueError(f"name: must be 1-128 of [A-Za-z0-9_.-], got {self.name!r}")
        parse_coordinators(self.coordinator)
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be 0-65535 (0 = off), got {self.metrics_port}")


class StaleEpoch(Exception):
    """A coordinator message from a leader older than the newest this agent has seen."""


@dataclass
class _LogRequest:
    """One log request being served: the session it belongs to and the credit it holds."""

    credit: int
    """Data chunks the coordinator will still take; -1 = no limit (a coordinator without
    credits)."""
    logs: asyncio.Queue[pb.NodeMessage]
    outbox: asyncio.Queue[pb.NodeMessage]
    more: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Held:
    """One round this agent runs (or ran and has not been released from)."""

    assignment: RoundAssignment
    group: WorkerGroup | None = None
    pids: dict[int, int] = field(default_factory=dict)
    exits: list[ReportedExit] = field(default_factory=list)
    failing: dict[int, ProcessFailure] = field(default_factory=dict)
    """Failures recorded by workers still running (local rank -> failure), sent before the exit."""
    stopped: bool = False
    stopping: asyncio.Task[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    unknown: str = ""
    """Why the group became UNKNOWN ("" = it did not); re-reported on every new session."""


class NodeAgent:
    """`async with NodeAgent(config):` keeps a session with the coordinator until the block ends."""

    def __init__(self, config: AgentConfig, *, nvml: Any | None = None) -> None:
        config.validate()
        self.config = config
        self._nvml = nvml
        """The pynvml module to use (None: import it, if installed)."""
        self.gpus: list[GpuDevice] = []
        self._gpu_monitor: GpuMonitor | None = None
        self._gpu_health: list[GpuHealth] = []
        self.slots = config.slots or os.cpu_count() or 1
        self.incarnation = uuid.uuid4().hex
        self.log_root = Path(config.log_dir or _default_log_dir(config.name)).resolve()
        self.state_dir = Path(config.state_dir).resolve() if config.state_dir else self.log_root
        if config.addr:
            check_addr(config.addr)
        self.coordinators = parse_coordinators(config.coordinator)
        """Every listed replica, in the given order."""
        self.target = self.coordinators[0]
        """The replica the current (or next) session dials."""
        self._unreachable = ""
        """The listed replica the last session could not reach, until a session is welcomed:
        told to the others, so that a standby still naming it as the leader holds the session."""
        self.epoch = 0
        """The newest leader epoch any coordinator message carried, for the life of the agent;
        a message with an older one is refused."""
        self._stale_logged = (-float("inf"), 0)  # (when, refusals since)
        self.addr = config.addr or _route_addr(self.target)
        self.security = Security.from_files(
            config.token_file,
            config.tls_ca,
            config.tls_cert,
            config.tls_key,
            config.tls_server_name,
            tls=config.tls,
            insecure=config.insecure,
        )
        for target in self.coordinators:
            self.security.check_target(target)
        self._held: dict[tuple[str, int], _Held] = {}
        self._outbox: asyncio.Queue[pb.NodeMessage] | None = None
        self._log_outbox: asyncio.Queue[pb.NodeMessage] | None = None
        self._outbox_full = asyncio.Event()
        self._log_requests: dict[int, _LogRequest] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self._log_tasks: dict[int, asyncio.Task[None]] = {}
        self._sentinel = Sentinel(token=self.incarnation)
        self._standbys = StandbyPool()
        self._registry = PidRegistry(self._pid_file(), mark_prefix=self._sentinel.mark_prefix)
        self._heartbeat_interval = 1.0
        self._closing = False
        self.connected = asyncio.Event()
        self.refused = asyncio.Event()
        """Set when the coordinator refused this agent for good; `refusal` says why."""
        self.refusal = ""
        self.metrics = AgentMetrics(config.name, config.metrics_host, config.metrics_port)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._main is not None:
            return
        await self._discover_gpus()
        await asyncio.to_thread(self._make_dirs)
        await asyncio.to_thread(self.metrics.start)
        killed = await asyncio.to_thread(reap_previous, self._pid_file())
        if killed:
            logger.warning("killed %d workers left by a previous agent: %s", len(killed), killed)
        # Before any worker: what a worker starts must die with this agent, however it dies.
        self._sentinel.start()
        self._main = asyncio.get_running_loop().create_task(self._run(), name="agent-session")
        if self._gpu_monitor is not None:
            self._spawn(self._sample_gpus(self._gpu_monitor), "gpu-health")

    async def _discover_gpus(self) -> None:
        """Find the GPUs to offer (ValueError when an explicit --gpus cannot be met)."""
        wanted = parse_gpus(self.config.gpus)
        nvml = self._nvml
        if wanted != "none" and nvml is None:
            nvml = await asyncio.to_thread(load_nvml)
        devices, handles, note = await asyncio.to_thread(discover_gpus, wanted, nvml, load=False)
        logger.info("%s", note)
        self.gpus = devices
        if devices:
            self._gpu_monitor = GpuMonitor(
                nvml, devices, handles, fault_file=os.environ.get(FAULT_FILE_ENV) or None
            )
            self._gpu_health = [GpuHealth(d.index) for d in devices]
            self.slots = self.config.slots or len(devices)

    async def _sample_gpus(self, monitor: GpuMonitor) -> None:
        # One sample at a time in a thread: a driver call that hangs holds one thread, never
        # the loop; heartbeats carry the latest sample taken.
        while True:
            try:
                self._gpu_health = await asyncio.to_thread(monitor.sample)
            except Exception:
                logger.exception("GPU sampling failed")
            await asyncio.sleep(self._heartbeat_interval)

    async def stop(self, grace: float | None = 5.0, *, leave_first: bool = False) -> None:
        """Stop the workers (SIGTERM, the grace, SIGKILL) and the agent; idempotent.

        `grace` None gives each group its job's `stop_grace`; a number bounds it. With
        `leave_first` (a SIGTERM to the agent, a drain) the session ends before any worker is
        stopped: the coordinator sees the node leave, which re-forms the job on the others
        without spending a restart, instead of workers stopped without its asking (a failure).
        """
        if self._closing:
            return
        self._closing = True
        if leave_first and self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
            self._main = None
        held = list(self._held.values())

        def grace_of(h: _Held) -> float:
            spec_grace = h.assignment.spec.stop_grace
            return spec_grace if grace is None else min(grace, spec_grace) if leave_first else grace

        await asyncio.gather(
            *(self._stop_group(h, grace_of(h)) for h in held), return_exceptions=True
        )
        await self._standbys.close()
        for t in [self._main, *self._tasks, *self._log_tasks.values()]:
            if t is not None:
                t.cancel()
        for t in [self._main, *self._tasks, *self._log_tasks.values()]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await t
                    except Exception:
                        logger.exception("agent task %s failed", t.get_name())
        self._main = None
        await self._sentinel.stop()
        await asyncio.to_thread(self.metrics.stop)

    async def __aenter__(self) -> NodeAgent:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _spawn(self, coro: object, name: str) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # ---- the session -----------------------------------------------------------------------

    async def _run(self) -> None:
        delay = 0.05
        refused_since: float | None = None
        last_log: tuple[str, float, float] = ("", 0.0, 0.0)  # (reason, pause, when)
        probed: dict[str, str] = {}
        hops = 0  # hints followed since the last pause
        hunting = 0  # attempts since the last session that worked that found no leader
        while not self._closing:
            started = time.monotonic()
            reason = ""
            hunted = False
            target = self.target
            # Unless told otherwise below, the next session tries the next listed replica.
            after = next_coordinator(self.coordinators, target, {target}) or target
            follow = False
            try:
                await self._session()
                if not self._closing:
                    reason = f"session with {target} closed by the coordinator"
            except asyncio.CancelledError:
                raise
            except StaleEpoch:
                reason = ""  # _check_epoch logged it, rate-limited
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), one_line(exc.details() or "")[:500]
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    # This node's previous session (or another live agent) holds the name. A
                    # dead holder's session ends within the time the coordinator says; past
                    # it the holder is alive and retrying cannot help.
                    now = time.monotonic()
                    refused_since = refused_since if refused_since is not None else now
                    if now - refused_since > _name_held_s(exc) + NAME_HELD_MARGIN_S:
                        self._refuse_for_good(
                            f"node name {self.config.name!r} is in use by another live agent "
                            f"(coordinator {target} refused this one for "
                            f"{now - refused_since:.0f} s: {details}); give this agent "
                            "another --name"
                        )
                        return
                    reason = f"coordinator refused this agent for now: {details}"
                    delay = min(delay, REFUSED_RETRY_MAX_S / 2)
                    after = target  # that coordinator holds the name: only it can free it
                elif code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    self._refuse_for_good(f"coordinator {target} refused this agent: {details}")
                    return
                else:
                    reason = f"session with {target} ended: {code.name}: {details}"
                    hint = leader_hint(exc.trailing_metadata(), self.coordinators)
                    # A standby that knows no leader yet, or a replica that does not answer.
                    hunted = code == grpc.StatusCode.UNAVAILABLE
                    listed = len(self.coordinators) > 1
                    if hunted and listed and not is_standby_answer(details, bool(hint)):
                        self._unreachable = target  # e.g. a leader that died
                    if code == grpc.StatusCode.UNAVAILABLE and hint and hint != target:
                        # A standby named the leader: straight there, a bounded number of times.
                        after, follow = hint, hops < len(self.coordinators)
                    elif code == grpc.StatusCode.UNAVAILABLE and any(
                        h in details.lower() for h in _PROBE_HINTS
                    ):
                        if details not in probed:
                            probed.clear()  # bounded: only the latest reason is remembered
                            probed[details] = await asyncio.to_thread(
                                _probe_tls, target, self.security
                            )
                        if probed[details]:
                            self._refuse_for_good(probed[details])
                            return
            except Exception as exc:
                logger.exception("session failed")
                reason = f"session failed: {type(exc).__name__}: {exc}"
            finally:
                if self.connected.is_set():
                    refused_since = None
                    probed.clear()
                    hunting = 0
                self.connected.clear()
                self._outbox = self._log_outbox = None
                # Their request ids belong to the session that ended.
                for task in list(self._log_tasks.values()):
                    task.cancel()
                self._log_requests.clear()
            if self._closing:
                return
            self.target = after
            if follow:
                hops += 1
                logger.info("%s; going to the leader it named, %s", reason, after)
                continue
            hops = 0
            if time.monotonic() - started > 10:
                delay = 0.05
            hunting = hunting + 1 if hunted else hunting
            low, high = reconnect_pause(delay, hunting if hunted else 0, len(self.coordinators))
            if reason:
                now = time.monotonic()
                said, was, when = last_log
                if reason != said or high != was or now - when > RETRY_LOG_EVERY_S:
                    where = f" at {after}" if len(self.coordinators) > 1 else ""
                    logger.warning("%s; retrying%s within %.2g s", reason, where, high)
                    last_log = (reason, high, now)
            # Jitter keeps a fleet of agents from reconnecting in lockstep; while hunting for
            # the leader over a list the pause stays short (bounded passes), else it doubles.
            await asyncio.sleep(random.uniform(low, high))
            if low == 0:
                delay = min(delay * 2, self.config.reconnect_max)

    def _refuse_for_good(self, reason: str) -> None:
        logger.error("%s", reason)
        self.refusal = reason
        self.refused.set()

    async def _session(self) -> None:
        outbox: asyncio.Queue[pb.NodeMessage] = asyncio.Queue(CONTROL_OUTBOX_LIMIT)
        logs: asyncio.Queue[pb.NodeMessage] = asyncio.Queue(LOG_OUTBOX_CHUNKS)
        self._outbox_full.clear()
        outbox.put_nowait(self._hello())
        async with self.security.aio_channel(
            self.target,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ],
        ) as channel:
            stub = pb_grpc.NodeSessionStub(channel)
            metadata = self.security.metadata
            if self._unreachable and self._unreachable != self.target:
                metadata += ((UNREACHABLE_HEADER, self._unreachable),)
            call = stub.Session(metadata=metadata)

            async def outgoing() -> None:
                # Our own task writing to the call (not a request iterator grpc would consume
                # in a task of its own): it ends with the session, however the session ends.
                while True:
                    # Control messages first: log chunks never hold up a heartbeat or an exit.
                    if outbox.empty() and not logs.empty():
                        await call.write(logs.get_nowait())
                        continue
                    msg = await outbox.get()
                    if msg is not _WAKE:
                        await call.write(msg)

            loop = asyncio.get_running_loop()
            # A write fails only once the call has ended, which the read side reports.
            writer = loop.create_task(outgoing(), name="agent-session-writer")
            heartbeat: asyncio.Task[None] | None = None
            full = loop.create_task(self._outbox_full.wait())
            full.add_done_callback(lambda _t: call.cancel())
            try:
                async for raw in call:
                    msg = self._read(raw)
                    if isinstance(msg, Welcome):
                        self._unreachable = ""
                        self._heartbeat_interval = max(0.05, msg.heartbeat_interval)
                        self._outbox, self._log_outbox = outbox, logs
                        # What the hello left out (it must fit one message however big the
                        # results): every held exit, each in a message of its own.
                        for m in self._replay():
                            self._put(outbox, m)
                        self.connected.set()
                        logger.info(
                            "registered with %s as %s (%s)%s",
                            self.target,
                            self.config.name,
                            self.addr,
                            f", leader epoch {self.epoch}" if self.epoch else "",
                        )
                        if heartbeat is None:
                            heartbeat = asyncio.get_running_loop().create_task(
                                self._heartbeats(outbox), name="agent-heartbeats"
                            )
                            # Without heartbeats the session is dead in all but name: end it,
                            # and the next one starts them again.
                            heartbeat.add_done_callback(_log_failure)
                            heartbeat.add_done_callback(
                                lambda t: t.cancelled() or t.exception() is None or call.cancel()
                            )
                    elif msg is not None:
                        self._dispatch(msg)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._outbox_full.is_set() and task is not None and not task.cancelling():
                    raise ConnectionError("the outbox to the coordinator is full") from None
                beat = heartbeat
                beat_failed = beat is not None and beat.done() and not beat.cancelled()
                beat_failed = beat_failed and beat is not None and beat.exception() is not None
                if beat_failed and task is not None and not task.cancelling():
                    raise ConnectionError("the heartbeats to the coordinator failed") from None
                raise
            finally:
                full.cancel()
                writer.cancel()
                if heartbeat is not None:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat
                call.cancel()
                # The writer's end (a write to a call that ended fails) is the session's end,
                # already reported by the read side.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
                with contextlib.suppress(asyncio.CancelledError):
                    await full

    def _read(self, raw: pb.CoordinatorMessage) -> CoordinatorMsg | None:
        """A message from the stream, decoded; StaleEpoch before anything of it is acted on
        (the welcome included) when it comes from an older leader; None for one this agent
        does not know."""
        msg: CoordinatorMsg | None = None
        error = ""
        try:
            msg = decode_coordinator(raw)
        except MessageError as exc:
            error = str(exc)
        self._check_epoch(raw.epoch, msg)
        if msg is None:
            logger.warning("ignoring an unknown message from the coordinator: %s", error)
        return msg

    def _check_epoch(self, epoch: int, msg: CoordinatorMsg | None) -> None:
        """Raise StaleEpoch for a message from a leader older than the newest seen; a newer
        epoch becomes the newest. Epoch 0 (one coordinator, no election) passes only while
        no coordinator has spoken with a higher one."""
        epoch = int(epoch)
        if epoch >= self.epoch:
            self.epoch = epoch
            return
        when, refused = self._stale_logged
        now = time.monotonic()
        kind = _kind(msg)
        if now - when >= STALE_LOG_EVERY_S:
            logger.warning(
                "refused %s from %s: it carries leader epoch %d, older than epoch %d seen "
                "before (a deposed leader); closing that session%s",
                kind,
                self.target,
                epoch,
                self.epoch,
                f" ({refused} more refused since the last report)" if refused else "",
            )
            self._stale_logged = (now, 0)
        else:
            self._stale_logged = (when, refused + 1)
        raise StaleEpoch(
            f"coordinator {self.target} speaks for leader epoch {epoch}, older than {self.epoch}; "
            f"its {kind} was not acted on"
        )

    def _tell(self, msg: NodeMsg) -> None:
        self._send(encode_node(msg))

    def _send(self, msg: pb.NodeMessage) -> None:
        if self._outbox is not None:
            self._put(self._outbox, msg)

    def _put(self, outbox: asyncio.Queue[pb.NodeMessage], msg: pb.NodeMessage) -> None:
        try:
            outbox.put_nowait(msg)
        except asyncio.QueueFull:
            # The stream has not drained for ages: drop the session; the next one re-reports
            # every start and exit the agent holds.
            if not self._outbox_full.is_set():
                logger.error("the outbox to the coordinator is full; dropping the session")
            self._outbox_full.set()

    def _hello(self) -> pb.NodeMessage:
        running = tuple(
            RunningGroup(
                job_id=job_id,
                round=round_,
                attempt=h.assignment.attempt,
                pids=tuple(h.pids.items()),
                global_ranks=tuple(_global(h, lr) for lr in h.pids),
                # The exits follow the welcome (see _replay); a stopped group with exits
                # to report says so after them, so they are not fenced off.
                stopped=h.stopped and not h.exits,
            )
            for (job_id, round_), h in self._held.items()
        )
        hello = Hello(
            name=self.config.name,
            addr=self.addr,
            slots=self.slots,
            incarnation=self.incarnation,
            version=VERSION,
            running=running,
            gpus=tuple(self.gpus),
        )
        return encode_node(hello)

    def _replay(self) -> list[pb.NodeMessage]:
        """The held exits (and then the stops) of every group, one bounded message each."""
        out: list[NodeMsg] = []
        for (job_id, round_), h in self._held.items():
            exited = {ex.local_rank for ex in h.exits}
            for lr, failure in h.failing.items():
                if lr not in exited:  # the coordinator ignores one it already has
                    out.append(WorkerFailing(job_id, round_, failure))
            out.extend(WorkerExited(job_id, round_, ex) for ex in h.exits)
            if h.unknown:
                out.append(GroupUnknown(job_id, round_, h.unknown))
            if h.stopped and h.exits:
                out.append(GroupStopped(job_id, round_))
        return [encode_node(m) for m in out]

    async def _heartbeats(self, outbox: asyncio.Queue[pb.NodeMessage]) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            seq += 1
            groups = []
            for (job_id, round_), h in self._held.items():
                if h.group is None:
                    continue
                workers = tuple(
                    WorkerHealthSample(
                        local_rank=s.local_rank,
                        pid=s.pid,
                        cpu_percent=s.cpu_percent,
                        rss_bytes=s.rss_bytes,
                        proc_state=s.status,
                        global_rank=s.global_rank,
                    )
                    for s in h.group.samples()
                )
                groups.append(
                    GroupHealth(job_id, round_, workers, h.group.state, h.group.state_reason)
                )
            beat = Heartbeat(seq=seq, groups=tuple(groups), gpus=tuple(self._gpu_health))
            self._put(outbox, encode_node(beat))
            self.metrics.observe(groups)

    # ---- commands --------------------------------------------------------------------------

    def _dispatch(self, msg: CoordinatorMsg | pb.CoordinatorMessage) -> None:
        """Carry out a message of the coordinator's (one as read from the stream is decoded)."""
        if isinstance(msg, pb.CoordinatorMessage):
            msg = decode_coordinator(msg)
        match msg:
            case ReservePort():
                self._reserve_port(msg)
            case Assign():
                self._assign(msg)
            case Stop():
                self._stop(msg)
            case Release():
                self._release(msg)
            case StartLogs():
                self._start_logs(msg)
            case CancelLogs():
                self._log_requests.pop(msg.request_id, None)
                task = self._log_tasks.pop(msg.request_id, None)
                if task is not None:
                    task.cancel()
            case LogCredit():
                req = self._log_requests.get(msg.request_id)
                if req is not None and req.credit >= 0:
                    req.credit = min(LOG_CREDIT_MAX, req.credit + max(0, msg.chunks))
                    req.more.set()
            case _:
                logger.warning("ignoring a %s from the coordinator", _kind(msg))

    def _reserve_port(self, m: ReservePort) -> None:
        port, error = 0, ""
        try:
            with socket.socket(socket.AF_INET6 if ":" in self.addr else socket.AF_INET) as s:
                s.bind((self.addr, 0))
                port = s.getsockname()[1]
        except OSError as exc:
            error = f"cannot bind a port on {self.addr}: {exc}"
        self._tell(PortReserved(m.job_id, m.round, port, error))

    def _assign(self, m: Assign | pb.Assign) -> None:
        if isinstance(m, pb.Assign):  # as the stream carries it
            m = _decode_assign(m)
        a = m.assignment
        key = (a.job_id, a.round)
        if key in self._held:
            logger.warning("ignoring a duplicate assignment %s", key)
            return
        why = ""
        spec = a.spec
        if not is_job_id(a.job_id):
            why = f"job id {a.job_id[:80]!r} is not one this agent accepts"
        else:
            try:
                if m.spec_error:
                    raise ValueError(m.spec_error)
                spec.validate()
            except (ValueError, TypeError) as exc:
                why = f"its spec does not validate here: {exc}"
            if not why and spec.roles:
                # A multi-role job: this node runs the group of one role, as a one-role spec.
                roles = {w.role for w in a.workers}
                if len(roles) != 1 or spec.role_named(next(iter(roles))) is None:
                    why = f"its workers name no single role of the spec ({sorted(roles)[:2]!r:.80})"
                else:
                    spec = role_spec(spec, next(iter(roles)))
        uuids = {d.index: d.uuid for d in self.gpus}
        gpus = a.gpus
        if not why and gpus:
            if len(gpus) != len(a.workers) or len(set(gpus)) != len(gpus):
                why = f"it gives {len(gpus)} GPUs to {len(a.workers)} workers"
            elif any(i not in uuids for i in gpus):
                why = f"it names GPUs {list(gpus)[:8]} but this node offers {sorted(uuids)}"
        if why:
            self._refuse(a, why)
            return
        # This agent's own uuids for those indices, not the message's.
        assignment = replace(a, spec=spec, gpu_uuids=tuple(uuids[i] for i in gpus))
        held = _Held(assignment)
        self._held[key] = held
        self._spawn(self._start_group(held), f"start-{a.job_id}-{a.round}")

    def _refuse(self, a: RoundAssignment, why: str) -> None:
        """Tell the coordinator that this assignment will not run, and why.

        Dropping it silently would leave the round assigned with no worker ever starting. Each
        rank of this node exits at once with a platform failure naming the reason, so the round
        fails now (and the job follows its restart budget) instead of at the start deadline.
        """
        message = f"node {self.config.name} refused the assignment of round {a.round}: {why}"
        logger.error("%s", message)
        now = time.time()
        for w in a.workers:
            failure = ProcessFailure(
                global_rank=w.global_rank,
                local_rank=w.local_rank,
                pid=0,
                exitcode=-1,
                message=message,
                timestamp=now,
                node=self.config.name,
                category=FailureCategory.PLATFORM,
            )
            exit_ = ReportedExit(
                local_rank=w.local_rank,
                global_rank=w.global_rank,
                pid=0,
                exitcode=-1,
                failure=failure,
                timestamp=now,
            )
            self._tell(WorkerExited(a.job_id, a.round, exit_))

    async def _start_group(self, held: _Held) -> None:
        try:
            await self._start_workers(held)
        except Exception as exc:
            # Whatever failed, the round's workers must not run unsupervised nor unreported.
            a = held.assignment
            logger.exception("job %s round %d: the start failed", a.job_id, a.round)
            reason = f"the start failed: {type(exc).__name__}: {exc}"
            if held.group is not None:
                held.group.go_unknown(reason)
            if not held.unknown:  # no group, or one already closed: say it here
                held.unknown = reason
                self._tell(GroupUnknown(a.job_id, a.round, reason))
            held.started.set()

    async def _start_workers(self, held: _Held) -> None:
        a = held.assignment
        key = (a.job_id, a.round)

        def on_exit(ex: WorkerExit) -> None:
            reported = _reported_exit(ex)
            held.exits.append(reported)
            self._tell(WorkerExited(a.job_id, a.round, reported))

        def on_failing(failure: ProcessFailure) -> None:
            held.failing[failure.local_rank] = failure
            self._tell(WorkerFailing(a.job_id, a.round, failure))

        def on_unknown(reason: str) -> None:
            # The group killed its workers before this; the report may be lost with the
            # session, so it is kept and replayed on the next.
            held.unknown = reason
            logger.error(
                "job %s attempt %d round %d: worker group UNKNOWN: %s",
                a.job_id,
                a.attempt,
                a.round,
                reason,
            )
            self._tell(GroupUnknown(a.job_id, a.round, reason))

        group = WorkerGroup(
            a,
            on_unknown=on_unknown,
            node_name=self.config.name,
            log_root=self.log_root,
            on_exit=on_exit,
            on_failing=on_failing,
            run_dir=self.state_dir,
            pid_registry=self._registry,
            spawner=self._standbys.spawner(a.job_id),
            warm_store=lambda _launch: self._standbys.take_store(a.job_id),
            before_spawn=lambda: self._prepare_zygote(a.job_id, group),
        )
        held.group = group
        launch = group.standby_launch()
        if launch is not None:
            # The job's first round here: standbys a finished job of the same spec left (a sweep).
            self._standbys.adopt(a.job_id, launch)
        try:
            pids = await group.start()
        finally:
            held.started.set()
        held.pids = dict(pids)
        if self._held.get(key) is not held or held.unknown:
            return
        self._fill_standbys(held)
        self._tell(
            WorkersStarted(
                a.job_id,
                a.round,
                tuple(pids.items()),
                tuple(_global(held, lr) for lr in pids),
            )
        )
        logger.info(
            "job %s attempt %d round %d: started ranks %s",
            a.job_id,
            a.attempt,
            a.round,
            {_global(held, lr): pid for lr, pid in pids.items()},
        )

    async def _prepare_zygote(self, job_id: str, group: WorkerGroup) -> None:
        """Before a round's workers start: its job's zygote (preload only), started if need be
        and waited for, so the workers are forked from it (see nodeagent._standby)."""
        launch = group.standby_launch()
        if launch is not None and not self._closing:
            await self._standbys.prepare(job_id, launch)

    def _fill_standbys(self, held: _Held) -> None:
        """Warm standbys for the job's next round on this node (only a spec with `preload`), as
        long as a next round can come to them (`can_serve`); else the job's spare ones go."""
        a = held.assignment
        launch = held.group.standby_launch() if held.group is not None else None
        if launch is None or self._closing:
            return
        if not can_serve(a):
            self._standbys.discard(a.job_id)
            return
        self._standbys.fill(a.job_id, launch, a.spec.nproc_per_node)
        store = held.group.store_launch if held.group is not None else None
        if store is not None:
            self._standbys.fill_store(a.job_id, store)

    def _stop(self, m: Stop) -> None:
        held = self._held.get((m.job_id, m.round))
        if held is None:
            self._tell(GroupStopped(m.job_id, m.round))
            return
        logger.info("job %s round %d: stopping (%s)", m.job_id, m.round, m.reason)
        # Every stop, a restart's and a re-form's too, gives the workers the job's grace: a
        # SIGTERM handler that saves a checkpoint finishes it. Workers that exit on SIGTERM (a
        # torch rank blocked in a collective does within tens of ms) cost the next round nothing.
        grace = m.grace
        if not m.replaced:
            self._standbys.discard(m.job_id)
        if held.stopping is None:
            held.stopping = asyncio.get_running_loop().create_task(
                self._stop_and_report(held, grace, replaced=m.replaced),
                name=f"stop-{m.job_id}-{m.round}",
            )
            held.stopping.add_done_callback(_log_failure)

    async def _stop_and_report(self, held: _Held, grace: float, *, replaced: bool = False) -> None:
        # Reported once the workers are gone; the group's close (the store host's teardown, the
        # log pumps) runs after, off the path of the round that replaces it.
        unkillable = await self._stop_group(held, grace, close=False)
        a = held.assignment
        if replaced and not any(k[0] == a.job_id and h is not held for k, h in self._held.items()):
            self._standbys.idle(a.job_id)
        self._tell(GroupStopped(a.job_id, a.round, tuple(unkillable)))
        self._held.pop((a.job_id, a.round), None)
        if held.group is not None:
            await held.group.close()

    async def _stop_group(self, held: _Held, grace: float, *, close: bool = True) -> list[int]:
        # A start still under way must finish spawning before it can be stopped as a unit.
        if held.group is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.started.wait(), 30.0)
        unkillable: list[int] = []
        if held.group is not None:
            unkillable = await held.group.stop(grace)
            if close:
                await held.group.close()
        held.stopped = True
        return unkillable

    def _release(self, m: Release) -> None:
        held = self._held.pop((m.job_id, m.round), None)
        # Released by the exit barrier: the job succeeded and is done here. Its standbys go, or
        # linger for the next job of the same spec when it asked for that.
        linger = held.assignment.spec.standby_linger if held is not None else 0.0
        self._standbys.release(m.job_id, min(linger, MAX_STANDBY_LINGER_S))
        if held is not None and held.group is not None:
            self._spawn(held.group.close(), "close-group")

    # ---- logs ------------------------------------------------------------------------------

    def _start_logs(self, m: StartLogs) -> None:
        outbox, logs = self._outbox, self._log_outbox
        if outbox is None or logs is None or m.request_id in self._log_tasks:
            return
        if len(self._log_tasks) >= LOG_REQUESTS_MAX:
            error = f"node {self.config.name} already serves {LOG_REQUESTS_MAX} logs"
            self._put(outbox, encode_node(LogChunk(m.request_id, eof=True, error=error)))
            return
        req = _LogRequest(m.credit_chunks if m.credit_chunks > 0 else -1, logs, outbox)
        self._log_requests[m.request_id] = req
        task = asyncio.get_running_loop().create_task(
            self._serve_logs(m, req), name=f"logs-{m.request_id}"
        )
        task.add_done_callback(_log_failure)
        self._log_tasks[m.request_id] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._log_tasks.get(m.request_id) is t:
                del self._log_tasks[m.request_id]
            if self._log_requests.get(m.request_id) is req:
                del self._log_requests[m.request_id]

        task.add_done_callback(done)

    async def _serve_logs(self, m: StartLogs, req: _LogRequest) -> None:
        """Send one log file, a chunk per credit the coordinator granted.

        The waits end with the request: a CancelLogs or the end of its session cancels it.
        """
        path = self._log_path(m.job_id, m.attempt, m.rank, m.stream)
        if path is None:
            error = (
                f"node {self.config.name} has no {m.stream} log for rank {m.rank} "
                f"of job {m.job_id} attempt {m.attempt}"
            )
            await self._emit_log(req, LogChunk(m.request_id, eof=True, error=error))
            return
        with open(path, "rb") as f:
            while True:
                while req.credit == 0:
                    req.more.clear()
                    await req.more.wait()
                data = f.read(LOG_CHUNK_BYTES)
                if data:
                    await self._emit_log(req, LogChunk(m.request_id, data=data))
                    continue
                if not m.follow or not self._rank_running(m.job_id, m.rank):
                    break
                await asyncio.sleep(0.2)
        await self._emit_log(req, LogChunk(m.request_id, eof=True))

    async def _emit_log(self, req: _LogRequest, chunk: LogChunk) -> None:
        if chunk.data and req.credit > 0:
            req.credit -= 1
        await req.logs.put(encode_node(chunk))
        self._put(req.outbox, _WAKE)

    def _log_path(self, job_id: str, attempt: int, rank: int, stream: str) -> Path | None:
        if not is_job_id(job_id) or stream not in ("stdout", "stderr") or rank < 0 or attempt < 0:
            return None
        for d in attempt_dirs(self.log_root, job_id, attempt):
            p = (d / str(rank) / f"{stream}.log").resolve()
            if p.is_relative_to(self.log_root) and p.is_file():
                return p
        return None

    def _rank_running(self, job_id: str, rank: int) -> bool:
        for (jid, _), h in self._held.items():
            if jid != job_id or h.stopped:
                continue
            exited = {e.global_rank for e in h.exits}
            if any(
                w.global_rank == rank and w.global_rank not in exited for w in h.assignment.workers
            ):
                return True
        return False

    # ---- bookkeeping -----------------------------------------------------------------------

    def _make_dirs(self) -> None:
        """Create (0700) and check the log root and state dir; raises OSError when unsafe.

        A directory given explicitly that someone else owns or may write to is refused. When
        the default cannot be made or is unsafe, a fresh temporary directory is used instead
        (and the reaper then has nothing of a previous run to find).
        """
        try:
            private_dir(self.log_root)
            private_dir(self.state_dir)
        except OSError as exc:
            if self.config.log_dir or self.config.state_dir:
                raise
            fresh = fresh_agent_dir(self.config.name)
            logger.warning("cannot use %s (%s); using %s", self.log_root, exc, fresh)
            self.log_root = self.state_dir = fresh
            self._registry.path = self._pid_file()
            private_dir(self.log_root)

    def _pid_file(self) -> Path:
        return self.state_dir / f"agent-{self.config.name}.pids.json"


def _log_failure(task: asyncio.Task[Any]) -> None:
    """Done callback of every agent task: an exception is logged, never lost."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("agent task %s failed", task.get_name(), exc_info=task.exception())


def _global(held: _Held, local_rank: int) -> int:
    for w in held.assignment.workers:
        if w.local_rank == local_rank:
            return w.global_rank
    return -1


def _reported_exit(ex: WorkerExit) -> ReportedExit:
    """A worker group's exit as the session reports it: the same facts, field by field."""
    return ReportedExit(
        local_rank=ex.local_rank,
        global_rank=ex.global_rank,
        pid=ex.pid,
        exitcode=ex.exitcode,
        stopped_by_agent=ex.stopped_by_agent,
        failure=ex.failure,
        return_value=ex.return_value,
        timestamp=ex.timestamp,
    )


def _kind(msg: CoordinatorMsg | None) -> str:
    """What a coordinator message is called on the wire ("assign", "reserve_port", ...)."""
    if msg is None:
        return "message"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(msg).__name__).lower()


def _decode_assign(m: pb.Assign) -> Assign:
    msg = decode_coordinator(pb.CoordinatorMessage(assign=m))
    assert isinstance(msg, Assign)
    return msg


def _route_addr(coordinator: str) -> str:
    """The local address that routes to the coordinator (no packet is sent)."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _name_held_s(exc: grpc.aio.AioRpcError) -> float:
    """How long the coordinator says a name can stay held by an agent that is gone."""
    metadata: Any = exc.trailing_metadata() or ()
    for key, value in metadata:
        if key == NAME_HELD_HEADER and isinstance(value, str) and value.isdigit():
            return min(int(value[:9]) / 1000, 24 * 3600.0)
    return NAME_HELD_DEFAULT_S


def _probe_tls(target: str, security: Security) -> str:
    """Why TLS fails between this agent and the coordinator ("" = TLS is not the problem)."""
    import sys

    from client.security import describe_tls_failure

    if sys.modules.get("ssl", False) is None:
        # The agent keeps ssl out of its memory (see nodeagent.cli); a failed connection that
        # may be a TLS mismatch is worth loading it for, once.
        del sys.modules["ssl"]
    verdict = describe_tls_failure(target, security)
    if not verdict:
        return ""
    # It ends the agent: a coordinator caught mid-restart must not pass for a wrong setting.
    time.sleep(PROBE_CONFIRM_S)
    return verdict if describe_tls_failure(target, security) == verdict else ""


def check_addr(addr: str) -> None:
    """Raise ValueError unless `addr` (--addr) is an address of this host (one can bind to)."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--addr {addr}: does not resolve ({exc.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(sockaddr)
        except OSError as exc:
            raise ValueError(
                f"--addr {addr}: not an address of this host ({exc.strerror}); peers reach "
                "this node's workers there, so it must be one of its own (see `ip addr`)"
            ) from None


def _default_log_dir(name: str) -> str:
    """The default log root of agent `name`: its own, never a predictable name in /tmp."""
    base = default_agent_dir(name, uid=os.geteuid(), env=os.environ, home=os.path.expanduser("~"))
    return str(base / "logs")
