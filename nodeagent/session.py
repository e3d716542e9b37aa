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

`NodeAgent` owns the agent's tasks and carries out what it is told; its rooms are
`nodeagent._agent_link` (the stream: sessions, reconnects, outboxes, heartbeat timer),
`nodeagent._agent_rounds` (the worker groups of the rounds it holds) and
`nodeagent._agent_logs` (log files served over the session). What it accepts and what it says
are decided in `nodeagent._agent_core`, on typed messages; `client.node_codec` is the one place
they meet the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from client.coordinators import parse_coordinators
from client.model import is_name
from client.node_codec import decode_coordinator, encode_node
from client.node_protocol import (
    Assign,
    CancelLogs,
    CoordinatorMsg,
    DrainAccepted,
    DrainRequest,
    LogCredit,
    NodeMsg,
    PortReserved,
    Release,
    ReservePort,
    StackRequest,
    StartLogs,
    Stop,
)
from client.plugins import MAX_PLUGINS
from client.security import Security
from nodeagent import _faults
from nodeagent._agent_core import (
    Refusal,
    StaleEpoch,
    check_assignment,
    group_health,
    heartbeat_of,
    hello,
    message_kind,
    rank_running,
    replay,
    stop_grace,
)
from nodeagent._agent_link import WAKE, LinkView, Outbox, SessionLink
from nodeagent._agent_link import one_line as one_line
from nodeagent._agent_logs import LOG_CHUNK_BYTES, LogService, log_task_failure
from nodeagent._agent_rounds import Held, RoundControl
from nodeagent._dirs import check_dir, default_agent_dir, fresh_agent_dir, private_dir
from nodeagent._gpus import (
    FAULT_FILE_ENV,
    GpuDevice,
    GpuHealth,
    GpuMonitor,
    discover_gpus,
    load_nvml,
    parse_gpus,
)
from nodeagent._metrics import AgentMetrics
from nodeagent._node_secret import NodeSecret, load_node_secret
from nodeagent._plugins import load_agent_plugins
from nodeagent._process import Sentinel
from nodeagent._progress_files import ProgressForwarder
from nodeagent._reaper import PidRegistry, reap_previous
from nodeagent._stacks import StackService, stack_targets
from nodeagent._standby import StandbyPool, can_serve
from protos.gelastic.v1 import gelastic_pb2 as pb

__all__ = ["AgentConfig", "NodeAgent", "StaleEpoch"]

logger = logging.getLogger(__name__)

DRAIN_ANSWER_S = 1.0
"""How long a stopping agent waits for its coordinator to accept its drain before it leaves
first instead."""
DRAIN_MARGIN_S = 5.0
"""How long past the drain's deadline a stopping agent waits for its workers to be gone before
it stops them itself."""

_Held = Held
"""A held round (`nodeagent._agent_rounds.Held`), under the name it had here."""


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
    """Where the agent keeps its worker pid file and its node secret ("" = log_dir): keep it
    across restarts, so that a restarted agent proves it is the same node."""
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
    plugins: tuple[str, ...] = ()
    """Site plug-ins, `module:object` each (nodeagent._plugins; docs/extending.md)."""
    plugin_timeout: float = 10.0
    """Seconds a plug-in's hook may take before it is ignored."""
    health_check_interval: float = 30.0
    """Seconds between two calls of the plug-ins' `health_check`."""

    def validate(self) -> None:
        if not 0 <= self.slots <= 4096:
            raise ValueError(f"slots: must be 1-4096 (0: the default), got {self.slots}")
        parse_gpus(self.gpus)
        if not is_name(self.name):
            raise ValueError(f"name: must be 1-128 of [A-Za-z0-9_.-], got {self.name!r}")
        parse_coordinators(self.coordinator)
        if not 0.05 <= self.reconnect_max <= 3600:
            raise ValueError(f"reconnect_max: must be 0.05-3600 s, got {self.reconnect_max}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be 0-65535 (0 = off), got {self.metrics_port}")
        if len(self.plugins) > MAX_PLUGINS:
            raise ValueError(f"plugins: at most {MAX_PLUGINS}, got {len(self.plugins)}")
        if not 0 < self.plugin_timeout <= 3600:
            raise ValueError(f"plugin_timeout: must be in (0, 3600] s, got {self.plugin_timeout}")
        if not 0.05 <= self.health_check_interval <= 86400:
            raise ValueError(
                f"health_check_interval: must be 0.05-86400 s, got {self.health_check_interval}"
            )


class NodeAgent(LinkView):
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
        self._node_secret = NodeSecret("")
        """Read (or made) at start, in the state dir: sent with every hello, never logged."""
        self.log_root = Path(config.log_dir or _default_log_dir(config.name)).resolve()
        self.state_dir = Path(config.state_dir).resolve() if config.state_dir else self.log_root
        if config.addr:
            check_addr(config.addr)
        coordinators = parse_coordinators(config.coordinator)
        self.addr = config.addr or _route_addr(coordinators[0])
        self.security = Security.from_files(
            config.token_file,
            config.tls_ca,
            config.tls_cert,
            config.tls_key,
            config.tls_server_name,
            tls=config.tls,
            insecure=config.insecure,
        )
        for target in coordinators:
            self.security.check_target(target)
        self._link = SessionLink(
            config.name,
            self.addr,
            coordinators,
            self.security,
            reconnect_max=config.reconnect_max,
            hello=self._hello,
            replay=self._replay,
            dispatch=self._dispatch,
            heartbeat=self._heartbeat,
            opened=self._opened,
            closed=self._closed,
            closing=lambda: self._closing,
        )
        self.connected = self._link.connected
        self.refused = self._link.refused
        """Set when the coordinator refused this agent for good; `refusal` says why."""
        self._outbox: Outbox | None = None
        """The control outbox of the session that is up (None between sessions)."""
        self._log_outbox: Outbox | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self._closing = False
        self._draining = False
        self._drain_answer: asyncio.Future[None] | None = None
        self._sentinel = Sentinel(token=self.incarnation)
        self.plugins = load_agent_plugins(config.plugins, timeout=config.plugin_timeout)
        self._standbys = StandbyPool()
        self._registry = PidRegistry(
            self._pid_file(), mark_prefix=self._sentinel.mark_prefix, write_behind=True
        )
        self._rounds = RoundControl(
            config.name,
            dirs=lambda: (self.log_root, self.state_dir),
            registry=self._registry,
            standbys=self._standbys,
            send=self._tell,
            spawn=self._spawn,
            # Looked up at each start: what warms the standbys can be swapped on the agent.
            started=lambda held: self._fill_standbys(held),
            closing=lambda: self._closing,
            plugins=self.plugins,
        )
        self._held = self._rounds.held
        self._logs = LogService(
            config.name,
            lambda: self.log_root,
            lambda job_id, rank: rank_running(self._held, job_id, rank),
            self._link.put,
            lambda outbox: self._link.put(outbox, WAKE),
            chunk_bytes=LOG_CHUNK_BYTES,
        )
        self._log_requests, self._log_tasks = self._logs.requests, self._logs.tasks
        self._stacks = StackService(
            config.name,
            lambda job_id, round_: stack_targets(self._held, job_id, round_),
            self._tell,
            self._spawn,
        )
        self._progress, self._progress_files = ProgressForwarder.of_held(
            lambda: self._held if self._outbox is not None else None, self._tell
        )
        self.metrics = AgentMetrics(config.name, config.metrics_host, config.metrics_port)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._main is not None:
            return
        await self._discover_gpus()
        await asyncio.to_thread(self._make_dirs)
        self._node_secret = await asyncio.to_thread(
            load_node_secret, self.state_dir, self.config.name
        )
        if self._node_secret.note:
            logger.warning("%s", self._node_secret.note)
        await asyncio.to_thread(self.metrics.start)
        killed = await asyncio.to_thread(reap_previous, self._pid_file())
        if killed:
            logger.warning("killed %d workers left by a previous agent: %s", len(killed), killed)
        self._rounds.open_metrics(self.state_dir / f"torch-metrics-{self.config.name}.fifo")
        # Before any worker: what a worker starts must die with this agent, however it dies.
        self._sentinel.start()
        self._main = asyncio.get_running_loop().create_task(self._link.run(), name="agent-session")
        if self._gpu_monitor is not None:
            self._spawn(self._sample_gpus(self._gpu_monitor), "gpu-health")
        self._spawn(self._progress.run(), "progress")
        if self.plugins.has("health_check"):
            self._spawn(self.plugins.watch_health(self.config.health_check_interval), "health")

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
            await asyncio.sleep(self._link.heartbeat_interval)

    async def stop(self, grace: float | None = 5.0, *, leave_first: bool = False) -> None:
        """Stop the workers (SIGTERM, the grace, SIGKILL) and the agent; idempotent.

        `grace` None gives each group its job's `stop_grace`; a number bounds it. With
        `leave_first` (a SIGTERM to the agent) the node is drained first: the coordinator
        replaces its rounds on the other nodes without spending a restart and stops their
        workers, with a notice, within `grace` (`_drain`), and the agent goes once they are
        gone. When the coordinator does not accept the drain promptly, the session ends before
        any worker is stopped instead: the coordinator sees the node leave, which re-forms the
        job the same way, rather than workers stopped without its asking (a failure).
        """
        if self._closing or self._draining:
            return
        drained = leave_first and self._main is not None and await self._drain(grace)
        self._closing = True
        if leave_first and not drained and self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
            self._main = None
        await self._rounds.stop_all(
            lambda h: stop_grace(h.assignment.spec.stop_grace, grace, leave_first=leave_first)
        )
        await self._standbys.close()
        await self._registry.flushed()
        tasks = [self._main, *self._tasks, *self._logs.tasks.values()]
        for t in tasks:
            if t is not None:
                t.cancel()
        for t in tasks:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await t
                    except Exception:
                        logger.exception("agent task %s failed", t.get_name())
        self._main = None
        self._node_secret.close()
        self._rounds.close_metrics()
        await self._sentinel.stop()
        await asyncio.to_thread(self.metrics.stop)

    async def _drain(self, grace: float | None) -> bool:
        """Ask the coordinator to drain this node (`grace`: its deadline; None: each job's
        stop_grace) and wait, bounded, until no worker runs here. False when the coordinator
        could not be asked or did not answer within DRAIN_ANSWER_S."""
        if self._outbox is None:
            return False
        self._draining = True
        loop = asyncio.get_running_loop()
        answer = self._drain_answer = loop.create_future()
        try:
            self._tell(DrainRequest(grace))
            try:
                await asyncio.wait_for(answer, DRAIN_ANSWER_S)
            except TimeoutError:
                logger.warning(
                    "the coordinator did not accept the drain within %g s; leaving first",
                    DRAIN_ANSWER_S,
                )
                return False
            longest = max((h.assignment.spec.stop_grace for h in self._held.values()), default=0)
            bound = (longest if grace is None else grace) + DRAIN_MARGIN_S
            logger.info("draining: waiting up to %.3g s for the workers to be gone", bound)
            until = loop.time() + bound
            while not self._rounds.idle() and loop.time() < until:
                await asyncio.sleep(0.05)
            # Let the last reports (the groups' stops) go out before the session ends.
            while self._outbox is not None and not self._outbox.empty() and loop.time() < until:
                await asyncio.sleep(0.01)
            return True
        finally:
            self._drain_answer = None
            self._draining = False

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
        task.add_done_callback(log_task_failure)

    # ---- the session -----------------------------------------------------------------------

    def _tell(self, msg: NodeMsg) -> None:
        self._send(_encode(msg))

    def _send(self, msg: pb.NodeMessage) -> None:
        if self._outbox is not None:
            self._link.put(self._outbox, msg)

    def _opened(self, outbox: Outbox, logs: Outbox) -> None:
        self._outbox, self._log_outbox = outbox, logs
        for files in self._progress_files.values():
            files.resend()

    def _closed(self) -> None:
        self._outbox = self._log_outbox = None
        self._logs.end_session()

    def _hello(self) -> pb.NodeMessage:
        return _encode(
            hello(
                self._held,
                name=self.config.name,
                addr=self.addr,
                slots=self.slots,
                incarnation=self.incarnation,
                gpus=self.gpus,
                node_secret=self._node_secret.value,
            )
        )

    def _replay(self) -> list[pb.NodeMessage]:
        """What follows the welcome: every held exit (and then the stops), each on its own."""
        return [_encode(m) for m in replay(self._held)]

    def _heartbeat(self, outbox: Outbox, seq: int) -> None:
        groups = [
            group_health(j, r, h.group.samples(), h.group.state, h.group.state_reason)
            for (j, r), h in self._held.items()
            if h.group is not None
        ]
        beat = heartbeat_of(
            seq, groups, self._gpu_health, self.plugins.health_problem, self._rounds.take_metrics()
        )
        self._link.put(outbox, encode_node(beat))
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
                self._rounds.stop(msg)
            case Release():
                self._rounds.release(msg)
            case StartLogs():
                self._logs.start(msg, self._outbox, self._log_outbox)
            case CancelLogs():
                self._logs.cancel(msg.request_id)
            case LogCredit():
                self._logs.credit(msg)
            case StackRequest():
                self._stacks.start(msg)
            case DrainAccepted():
                if self._drain_answer is not None and not self._drain_answer.done():
                    self._drain_answer.set_result(None)
            case _:
                logger.warning("ignoring a %s from the coordinator", message_kind(msg))

    def _reserve_port(self, m: ReservePort) -> None:
        # A numeric address (the usual: the one routing to the coordinator) is bound at once;
        # a name is looked up in a thread, never on the event loop on the round's path.
        try:
            info = socket.getaddrinfo(self.addr, 0, flags=socket.AI_NUMERICHOST)[0]
        except socket.gaierror:
            self._spawn(self._reserve_named_port(m), f"reserve-port-{m.job_id}-{m.round}")
            return
        self._tell(_port_reserved(m, self.addr, info))

    async def _reserve_named_port(self, m: ReservePort) -> None:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.addr, 0)
        except OSError as exc:
            self._tell(_port_reserved(m, self.addr, exc))
            return
        self._tell(_port_reserved(m, self.addr, infos[0]))

    def _assign(self, m: Assign | pb.Assign) -> None:
        if isinstance(m, pb.Assign):  # as the stream carries it
            m = _decode_assign(m)
        a = m.assignment
        key = (a.job_id, a.round)
        if key in self._held:
            logger.warning("ignoring a duplicate assignment %s", key)
            return
        checked = check_assignment(m, self.gpus)
        if isinstance(checked, Refusal):
            logger.error("%s", checked.message(self.config.name, a.round))
            for exited in checked.exits(a, self.config.name, time.time()):
                self._tell(exited)
            return
        self._rounds.run(checked)

    def _fill_standbys(self, held: Held) -> None:
        """Warm standbys for the job's next round on this node (a python job's), as long as a
        next round can come to them (`can_serve`); else the job's spare ones go. A warm store
        host only for a spec with `preload`: without one it would idle with torch imported
        (hundreds of MB) to save a start that is off the workers' path."""
        a = held.assignment
        launch = held.group.standby_launch() if held.group is not None else None
        if launch is None or self._closing:
            return
        if not can_serve(a):
            self._standbys.discard(a.job_id)
            return
        self._standbys.fill(a.job_id, launch, a.spec.nproc_per_node)
        store = held.group.store_launch if held.group is not None else None
        if store is not None and launch.preload:
            self._standbys.fill_store(a.job_id, store)

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
            # They are used resolved; the links on the way there, as given, are checked too.
            for given in (self.config.log_dir, self.config.state_dir):
                if given:
                    check_dir(Path(given))
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


def _port_reserved(m: ReservePort, addr: str, found: tuple[Any, ...] | OSError) -> PortReserved:
    """The answer to `m`: a free port bound (and let go) at `addr`, found as `found`."""
    port, error = 0, ""
    try:
        if isinstance(found, OSError):
            raise found
        family, _, _, _, sockaddr = found
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr)
            port = s.getsockname()[1]
    except OSError as exc:
        error = f"cannot bind a port on {addr}: {exc}"
    return PortReserved(m.job_id, m.round, port, error)


def _encode(msg: NodeMsg) -> pb.NodeMessage:
    """What the agent says, its times on this host's clock (skewed only by a test's fault)."""
    return encode_node(_faults.skewed(msg))


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
