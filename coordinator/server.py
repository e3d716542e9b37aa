"""The coordinator process: a grpc.aio server hosting the service, with start/stop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from client.metrics_http import LISTEN_BACKLOG as METRICS_BACKLOG
from client.metrics_http import MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from client.metrics_http import MetricsEndpoint
from client.plugins import MAX_PLUGINS
from client.security import check_tls_files, is_loopback, read_token
from coordinator._auth import ServerTLS, TokenInterceptor
from coordinator._cluster import ClusterConfig
from coordinator._connections import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    connection_cap,
    grpc_server_options,
    open_files_limit,
)
from coordinator._dashboard_guard import DEFAULT_MAX_CONNECTIONS as DASHBOARD_MAX_CONNECTIONS
from coordinator._dashboard_guard import LISTEN_BACKLOG as DASHBOARD_BACKLOG
from coordinator._event_sinks import open_event_sinks
from coordinator._leader import (
    DEFAULT_TTL_S,
    MAX_TTL_S,
    MIN_TTL_S,
    LeaderGate,
    Leadership,
    Term,
    parse_advertise,
)
from coordinator._probes import Probes
from coordinator._service import CoordinatorService
from coordinator._store import MEMORY, Fence, StateStore, Store, default_state_dir
from coordinator._store_etcd import EtcdSettings, EtcdStore, parse_etcd_url

if TYPE_CHECKING:
    from coordinator._dashboard import Dashboard
    from coordinator._metrics import CoordinatorMetrics

__all__ = ["Coordinator", "CoordinatorConfig", "is_loopback"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator listens and times nodes. CLI flags map one-to-one onto fields."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 29400
    """Port to listen on (0 = any free port)."""
    heartbeat_interval: float = 1.0
    """Seconds between agent heartbeats."""
    lease: float = 5.0
    """Seconds without a message after which a node is lost."""
    insecure: bool = False
    """Allow listening on a non-loopback address without authentication, or without TLS, and an
    etcd store off loopback without TLS."""
    state_dir: str = field(default_factory=default_state_dir)
    """Where the durable state lives (SQLite); ":memory:" keeps nothing across restarts."""
    store: str = ""
    """The store: "" or "sqlite" = SQLite in state_dir; "etcd://HOST:PORT[,...]/PREFIX" = etcd."""
    etcd_ca: str = ""
    """PEM CA of the etcd members' certificates (TLS to etcd)."""
    etcd_cert: str = ""
    """PEM client certificate for etcd."""
    etcd_key: str = ""
    """PEM private key of etcd_cert."""
    etcd_user: str = ""
    """etcd user to authenticate as ("" = none)."""
    etcd_password_file: str = ""
    """File holding etcd_user's password."""
    advertise: str = ""
    """With etcd: HOST:PORT agents and clients reach this replica at ("" = the address it
    listens on, a wildcard host replaced by this host's name)."""
    leader_ttl: float = DEFAULT_TTL_S
    """With etcd: seconds of the leader lease; a leader that cannot refresh it steps down
    sooner, a standby takes over once it expired."""
    reconnect_grace: float = 15.0
    """After a restart, seconds a known node has to reconnect before it counts as lost."""
    retain_jobs: int = 10_000
    """Finished jobs kept, with their events and results; the oldest beyond are deleted."""
    retain_seconds: float = 7 * 24 * 3600.0
    """How long a finished job, and a node that is gone, is kept before it is deleted."""
    lost_node_retention: float = 24 * 3600.0
    """How long a lost node stays listed (from when it was last seen) before it is dropped."""
    start_timeout: float = 120.0
    """Seconds a node has, from a round's assignment, until all its workers reported started;
    past it the round fails (a platform failure that spends one restart)."""
    quarantine_ttl: float = 3600.0
    flaky_rounds: int = 3
    """Rounds whose first failure was on one node, while the round's other nodes were healthy,
    that quarantine that node (0 = never)."""
    flaky_window: float = 600.0
    """Seconds within which `flaky_rounds` such rounds quarantine the node."""
    """Seconds a node stays quarantined (a GPU lost or with new uncorrectable errors) unless an
    operator clears it first (`gelastic nodes --clear-quarantine NAME`)."""
    token_file: str = ""
    """File holding the shared token agents and clients must present ("" = no token)."""
    agent_token_file: str = ""
    """A separate token for agents (overrides token_file for the node sessions)."""
    client_token_file: str = ""
    """A separate token for clients (overrides token_file for the client API)."""
    tls_cert: str = ""
    """PEM certificate to serve TLS with ("" = plain text)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA whose client certificates are required (mTLS; "" = no client certificates)."""
    require_cert_node_names: bool = False
    """With mTLS: an agent's node name must be a DNS name (or, without any, the common name) of
    its client certificate; a session under another name is refused."""
    metrics_port: int = 0
    """Port to serve Prometheus metrics on over HTTP (0 = no metrics)."""
    metrics_host: str = "127.0.0.1"
    """Address to serve the metrics on."""
    event_sinks: tuple[str, ...] = ()
    """Where every job event also goes: `module:object` plug-ins, or `jsonl:/path` (see
    coordinator._event_sinks and docs/extending.md); plus the `gelastic.event_sinks` entry points."""
    event_log: str = ""
    """A JSON-lines file (0600, rotated by size) every job event is appended to ("" = none)."""
    dashboard_port: int = 0
    """Port to serve the web dashboard on (0 = no dashboard). It listens on `host`, with the
    same client token and TLS as the gRPC port (docs/deployment.md, "Web dashboard")."""
    dashboard_without_token: bool = False
    """Serve the dashboard even without a client token (to anyone who reaches it); without
    this, a dashboard without a token refuses to start."""
    max_connections: int = 0
    """gRPC connections open at once; one more is closed at its accept (0 = the open-files
    limit less room for the rest of the process, at least 32; see coordinator._connections)."""
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    """Seconds a new gRPC connection has to finish TLS and send its HTTP/2 settings."""
    connection_idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    """Seconds a gRPC connection with no call open may stay (a client reconnects by itself)."""

    def etcd_settings(self) -> EtcdSettings | None:
        """The etcd store's settings (None: SQLite). Raises ValueError naming the bad value."""
        if self.store in ("", "sqlite"):
            if self.etcd_ca or self.etcd_cert or self.etcd_key or self.etcd_user:
                raise ValueError("the --etcd-* options need --store etcd://...")
            return None
        endpoints, prefix = parse_etcd_url(self.store)
        settings = EtcdSettings(
            endpoints,
            prefix,
            ca_file=self.etcd_ca,
            cert_file=self.etcd_cert,
            key_file=self.etcd_key,
            user=self.etcd_user,
            password_file=self.etcd_password_file,
        )
        settings.validate()
        return settings

    def tokens(self) -> tuple[str, str]:
        """(agent token, client token); empty when not configured. Raises ValueError."""
        shared = read_token(self.token_file) if self.token_file else ""
        agent = read_token(self.agent_token_file) if self.agent_token_file else shared
        client = read_token(self.client_token_file) if self.client_token_file else shared
        return agent, client

    @property
    def authenticated(self) -> bool:
        return bool(self.token_file or (self.agent_token_file and self.client_token_file))

    def check_dashboard_token(self) -> None:
        """Raises ValueError unless the dashboard may start: a client token, or asked without."""
        if self.tokens()[1] or self.dashboard_without_token:
            return
        raise ValueError(
            "refusing to serve the dashboard without a token: anyone who can reach "
            f"{self.host} (every local user on loopback) could read every job, its spec and its "
            "logs. Use --token-file (or --client-token-file), or --dashboard-without-token to "
            "accept the risk"
        )

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be 0-65535, got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be 0-65535 (0 = off), got {self.metrics_port}")
        if len(self.event_sinks) > MAX_PLUGINS:
            raise ValueError(f"event_sinks: at most {MAX_PLUGINS}, got {len(self.event_sinks)}")
        if not 0 <= self.dashboard_port < 65536:
            raise ValueError(
                f"dashboard_port: must be 0-65535 (0 = off), got {self.dashboard_port}"
            )
        if not 0 < self.heartbeat_interval <= 60:
            raise ValueError(
                f"heartbeat_interval: must be in (0, 60] s, got {self.heartbeat_interval}"
            )
        if not self.heartbeat_interval < self.lease <= 3600:
            raise ValueError(
                f"lease: must be longer than heartbeat_interval and at most 3600 s, got {self.lease}"
            )
        if not 0 <= self.retain_jobs <= 10_000_000:
            raise ValueError(f"retain_jobs: must be 0-10000000, got {self.retain_jobs}")
        if not 0 <= self.retain_seconds <= 10 * 365 * 86400:
            raise ValueError(f"retain_seconds: must be 0 to 10 years, got {self.retain_seconds}")
        if not 0 <= self.lost_node_retention <= 10 * 365 * 86400:
            raise ValueError(
                f"lost_node_retention: must be 0 to 10 years, got {self.lost_node_retention}"
            )
        etcd = self.etcd_settings()
        if etcd is not None and not etcd.tls and not self.insecure:
            remote = [
                e for e in etcd.endpoints if not is_loopback(e.rpartition(":")[0].strip("[]"))
            ]
            if remote:
                raise ValueError(
                    f"refusing to use etcd at {remote[0]} without TLS: the store holds every job "
                    "spec in full (env values and result keys included), and the etcd password, "
                    "which would cross the network in clear text. Use --etcd-ca (and "
                    "--etcd-cert/--etcd-key), or --insecure to accept the risk"
                )
        if not MIN_TTL_S <= self.leader_ttl <= MAX_TTL_S:
            raise ValueError(
                f"leader_ttl: must be {MIN_TTL_S:g}-{MAX_TTL_S:g} s, got {self.leader_ttl}"
            )
        if self.advertise:
            if etcd is None:
                raise ValueError("--advertise is for replicas: it needs --store etcd://...")
            parse_advertise(self.advertise)
        if not 0 < self.start_timeout <= 7 * 86400:
            raise ValueError(f"start_timeout: must be in (0, 7 days] s, got {self.start_timeout}")
        if not 0 < self.quarantine_ttl <= 365 * 86400:
            raise ValueError(f"quarantine_ttl: must be in (0, 1 year] s, got {self.quarantine_ttl}")
        if not 0 <= self.flaky_rounds <= 1000:
            raise ValueError(f"flaky_rounds: must be 0-1000, got {self.flaky_rounds}")
        if not 0 < self.flaky_window <= 7 * 86400:
            raise ValueError(f"flaky_window: must be in (0, 7 days] s, got {self.flaky_window}")
        if not 0 <= self.max_connections <= 10_000_000:
            raise ValueError(
                f"max_connections: must be 0-10000000 (0 = from the open-files limit), "
                f"got {self.max_connections}"
            )
        if not 0 < self.handshake_timeout <= 600:
            raise ValueError(
                f"handshake_timeout: must be in (0, 600] s, got {self.handshake_timeout}"
            )
        if not 0 < self.connection_idle_timeout <= 7 * 86400:
            raise ValueError(
                "connection_idle_timeout: must be in (0, 7 days] s, "
                f"got {self.connection_idle_timeout}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        check_tls_files(
            self.tls_cert,
            self.tls_key,
            self.tls_client_ca,
            flags=("--tls-cert", "--tls-key", "--tls-client-ca"),
        )
        if (self.agent_token_file or self.client_token_file) and not self.authenticated:
            raise ValueError(
                "with separate tokens give both --agent-token-file and --client-token-file "
                "(or a shared --token-file)"
            )
        if self.require_cert_node_names and not self.tls_client_ca:
            raise ValueError(
                "require_cert_node_names (--require-cert-node-names) needs mTLS: --tls-client-ca"
            )
        self.tokens()
        if self.dashboard_port:
            self.check_dashboard_token()
        if self.insecure or is_loopback(self.host):
            return
        if not self.authenticated:
            raise ValueError(
                f"refusing to listen on {self.host} without a token: anyone who can reach this "
                "address could run programs on every node. Use --token-file (and TLS), or "
                "--insecure to accept the risk"
            )
        if not self.tls_cert:
            raise ValueError(
                f"refusing to listen on {self.host} with a token but without TLS: the token would "
                "cross the network in clear text, and whoever reads it can run programs on every "
                "node. Use --tls-cert and --tls-key, or --insecure to accept the risk"
            )


def check_bindable(host: str, port: int, what: str = "listen") -> None:
    """Raise OSError naming the address and the reason unless host:port can be bound here.

    grpc says only "Failed to bind to address": a port in use, an address this host does not
    have and a name that does not resolve are told apart here, before grpc tries.
    """
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(
            f"cannot {what} on {shown}: {host!r} does not resolve ({exc.strerror})"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As grpc binds: SO_REUSEADDR, so only a port someone listens on counts as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
            if port:
                s.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = "the port is in use (is another coordinator running? pick another port)"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = "this host has no such address (see `ip addr`)"
            elif exc.errno == errno.EACCES:
                why = "permission denied (ports below 1024 need privileges)"
            else:
                why = exc.strerror or str(exc)
            raise OSError(f"cannot {what} on {shown}: {why}") from None


def _lock_state_dir(state_dir: str) -> int | None:
    """Hold an exclusive lock on the state dir: two coordinators on one state would corrupt it."""
    if state_dir == MEMORY:
        return None
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(state_dir, "coordinator.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"another coordinator is using the state dir {state_dir}") from None
    return fd


def _open_store(config: CoordinatorConfig) -> tuple[int | None, StateStore]:
    """(state dir lock, store) for the configured store."""
    etcd = config.etcd_settings()
    fd = None if etcd is not None else _lock_state_dir(config.state_dir)
    store: StateStore = EtcdStore(etcd) if etcd is not None else Store(config.state_dir)
    logger.info("coordinator state: %s", store.describe())
    return fd, store


class Coordinator:
    """`async with Coordinator(config) as c:` serves until the block ends."""

    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.config.validate()
        self._lock_fd, self.store = _open_store(self.config)
        self.replicated = isinstance(self.store, EtcdStore)
        """With etcd: one of several replicas, serving only while elected leader."""
        self.replica_id = uuid.uuid4().hex
        self.leadership: Leadership | None = None
        self._gate: LeaderGate | None = (
            LeaderGate(lambda: self.leadership.leader_addr if self.leadership else "")
            if self.replicated
            else None
        )
        self._leader_task: asyncio.Task[None] | None = None
        self._took_over = asyncio.Event()
        # A standby holds no state: its service is an empty one that never runs (the gate
        # answers every call); the leader's is loaded from the store when it wins.
        self.service = self._new_service(None if self.replicated else self.store)
        self.metrics: CoordinatorMetrics | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        if self.config.metrics_port:
            # Imported here: a coordinator without metrics does not load prometheus_client.
            from coordinator._metrics import CoordinatorMetrics

            self.metrics = CoordinatorMetrics(self.service.cluster, self.service.now)
            if self.replicated:
                self.metrics.leading = lambda: self.leading
            self.service.effect_observers.append(self.metrics.observe)
            self.service.heartbeat_observers.append(self.metrics.observe_heartbeat)
            self._metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, self.config.metrics_host, self.config.metrics_port
            )
        self.event_sinks = open_event_sinks(self.config.event_sinks, self.config.event_log)
        """Where every job event also goes (None: nowhere else); see coordinator._event_sinks."""
        if self.event_sinks is not None:
            self.service.effect_observers.append(self.event_sinks.observe)
            if self.metrics is not None:
                self.metrics.sink_drops = self.event_sinks.dropped
        self._server: grpc.aio.Server | None = None
        self._probes: Probes | None = None
        self.port = 0
        self.dashboard: Dashboard | None = None

    def _new_service(self, store: StateStore | None) -> CoordinatorService:
        service = CoordinatorService(
            ClusterConfig(
                heartbeat_interval=self.config.heartbeat_interval,
                lease=self.config.lease,
                retain_jobs=self.config.retain_jobs,
                retain_seconds=self.config.retain_seconds,
                lost_node_retention=self.config.lost_node_retention,
                start_timeout=self.config.start_timeout,
                quarantine_ttl=self.config.quarantine_ttl,
                flaky_rounds=self.config.flaky_rounds,
                flaky_window=self.config.flaky_window,
            ),
            store=store,
            reconnect_grace=self.config.reconnect_grace,
        )
        service.require_cert_node_names = self.config.require_cert_node_names
        if store is None and isinstance(self.store, EtcdStore):
            service.may_send = lambda: False  # a standby's: it sends nothing, ever
        return service

    def _switch_service(self, service: CoordinatorService) -> None:
        old, self.service = self.service, service
        if self.metrics is not None:
            with contextlib.suppress(ValueError):
                old.effect_observers.remove(self.metrics.observe)
                old.heartbeat_observers.remove(self.metrics.observe_heartbeat)
            self.metrics.adopt(service.cluster)
            service.effect_observers.append(self.metrics.observe)
            service.heartbeat_observers.append(self.metrics.observe_heartbeat)
        if self.event_sinks is not None:
            with contextlib.suppress(ValueError):
                old.effect_observers.remove(self.event_sinks.observe)
            service.effect_observers.append(self.event_sinks.observe)
        if self.dashboard is not None:
            service.dashboard = old.dashboard
            self.dashboard.adopt(service)

    @property
    def leading(self) -> bool:
        """True while this coordinator serves: always with SQLite, while elected with etcd."""
        return self._gate is None or self._gate.term is not None

    def max_connections(self) -> int:
        """The gRPC port's cap on connections open at once (`CoordinatorConfig.max_connections`,
        else what the open-files limit leaves once the dashboard and metrics have their caps)."""
        c = self.config
        if c.max_connections:
            return c.max_connections
        elsewhere = 0
        if c.dashboard_port:
            elsewhere += DASHBOARD_MAX_CONNECTIONS + DASHBOARD_BACKLOG
        if c.metrics_port:
            elsewhere += METRICS_MAX_CONNECTIONS + METRICS_BACKLOG
        return connection_cap(open_files_limit(), elsewhere)

    @property
    def address(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        if self._server is not None:
            return
        check_bindable(self.config.host, self.config.port)
        if self.event_sinks is not None:
            self.event_sinks.start()
        if self.config.metrics_port:
            check_bindable(
                self.config.metrics_host, self.config.metrics_port, "serve metrics (--metrics-port)"
            )
        agent_token, client_token = self.config.tokens()
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = (
            [TokenInterceptor(agent_token, client_token, self.service.refusals)]
            if agent_token
            else []
        )
        if self._gate is not None:
            interceptors.append(self._gate)  # after the token: no leader address to strangers
        c = self.config
        cap = self.max_connections()
        server = grpc.aio.server(
            interceptors=interceptors,
            options=grpc_server_options(
                MAX_MESSAGE_BYTES,
                cap,
                handshake_timeout=c.handshake_timeout,
                idle_timeout=c.connection_idle_timeout,
            ),
        )
        self.service.add_to_server(server, lambda: self.service)
        probes = Probes(server)
        await probes.starting()
        host = c.host
        bind = f"[{host}]:{c.port}" if ":" in host else f"{host}:{c.port}"
        try:
            if c.tls_cert:
                creds = ServerTLS(c.tls_cert, c.tls_key, c.tls_client_ca).credentials()
                self.port = server.add_secure_port(bind, creds)
            else:
                self.port = server.add_insecure_port(bind)
        except RuntimeError:  # grpc's "Failed to bind": what check_bindable could not foresee
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not listen on {bind}")
        if self._metrics_endpoint is not None:
            try:
                await asyncio.to_thread(self._metrics_endpoint.start)
            except OSError:
                await server.stop(None)
                raise
        if c.dashboard_port:
            try:
                await self.start_dashboard(c.dashboard_port)
            except OSError:
                await server.stop(None)
                if self._metrics_endpoint is not None:
                    await asyncio.to_thread(self._metrics_endpoint.stop)
                raise
        await server.start()
        self._server, self._probes = server, probes
        if self.replicated:
            await self._start_election()
        else:
            self.service.start()
            await probes.serving()
        logger.info("coordinator listening on %s (at most %d connections)", self.address, cap)
        if not agent_token and not c.tls_client_ca:
            logger.warning(
                "coordinator on %s has no token: every local user (and anyone else who can reach "
                "this address) can submit jobs through it, and the agents run them as their own "
                "users; use --token-file",
                self.address,
            )

    # ---- replicas ------------------------------------------------------------------------

    def advertised(self) -> str:
        """The address agents and clients reach this replica at."""
        if self.config.advertise:
            return self.config.advertise
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def _start_election(self) -> None:
        assert isinstance(self.store, EtcdStore) and self._probes is not None
        await self._probes.standby()
        leadership = Leadership(
            self.store, self.replica_id, self.advertised(), self.config.leader_ttl
        )
        self.leadership = leadership
        assert self._gate is not None
        gate = self._gate
        # Long enough for the lease of a leader that died to run out (etcd checks for expired
        # leases twice a second) and a standby to take over.
        gate.configure_hold(leadership.advertise, self.config.leader_ttl + 1.0)
        leadership.on_change = gate.changed
        leadership.eager = lambda: gate.held > 0
        self._leader_task = asyncio.get_running_loop().create_task(
            leadership.run(self._elected, self._deposed), name="election"
        )
        # A lone replica serves once start() returns; one that lost waits as a standby.
        wait = 2 * self.config.leader_ttl + 5.0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await leadership.first_round.wait()
                if leadership.leading():
                    await self._took_over.wait()
        logger.info(
            "coordinator replica %s: %s",
            self.advertised(),
            "leads" if self.leading else f"stands by (leader: {leadership.leader_addr or 'none'})",
        )

    async def _elected(self, epoch: int) -> None:
        """Take over as after a restart: fence the store, load the state, then serve."""
        assert self.leadership is not None and self._gate is not None
        store = self.store
        assert isinstance(store, EtcdStore)

        def load() -> CoordinatorService:
            # In a thread: set_fence waits for a write of an earlier term still under way.
            store.set_fence(Fence(store.leader_key(), epoch))
            return self._new_service(store)

        started = time.monotonic()
        service = await asyncio.to_thread(load)
        logger.info("epoch %d: the state is loaded (%.2f s)", epoch, time.monotonic() - started)
        service.epoch = epoch
        service.may_send = self.leadership.leading
        service.on_fenced = self.leadership.depose
        self._switch_service(service)
        service.start()
        self._gate.term = Term(epoch)
        if self._probes is not None:
            await self._probes.serving()
        self._took_over.set()

    async def _deposed(self, reason: str) -> None:
        """Stop acting at once: end every call of the term, drop the state, stand by."""
        assert self._gate is not None
        term, self._gate.term = self._gate.term, None
        if term is not None:
            term.ended.set()
        self._took_over.clear()
        service = self.service
        await service.abandon()
        # The fence stays: a write of the old term still under way fails at etcd.
        self._switch_service(self._new_service(None))
        if self._probes is not None and self._server is not None:
            await self._probes.standby()

    async def start_dashboard(self, port: int = 0) -> str:
        """Serve the web dashboard on `port` of the coordinator's host (0 = any free port), with
        the client token and TLS of the gRPC port; return its URL. Idempotent."""
        if self.dashboard is not None:
            return self.dashboard.url
        self.config.check_dashboard_token()
        # Imported here: a coordinator without a dashboard does not load aiohttp.
        from coordinator._dashboard import Dashboard, server_ssl_context

        c = self.config
        tls = server_ssl_context(c.tls_cert, c.tls_key, c.tls_client_ca) if c.tls_cert else None
        advertised = self.advertised().rpartition(":")[0]
        dashboard = Dashboard(
            self.service, c.host, port, self.config.tokens()[1], tls, names=[advertised]
        )
        gate = self._gate
        if gate is not None:
            dashboard.model.standby = lambda: (
                "" if gate.term is not None else f"Standby replica ({gate.refusal()[0]})."
            )
        await dashboard.start()
        self.dashboard = dashboard
        self.service.dashboard = (dashboard.scheme, c.host, dashboard.port)
        return dashboard.url

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if self._probes is not None:
            await self._probes.stopping()
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
            self.service.dashboard = None
        if self.leading:
            # While the lease is still kept alive: the last writes are fenced on this term.
            await self.service.stop()
        if self._leader_task is not None:
            self._leader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._leader_task
            self._leader_task = None
        if self.leadership is not None:
            # Revoked, not left to expire: a standby takes over at its next poll.
            await self.leadership.resign()
            self.leadership.close()
        if self._gate is not None and self._gate.term is not None:
            self._gate.term.ended.set()
            self._gate.term = None
        await server.stop(grace)
        if self._metrics_endpoint is not None:
            await asyncio.to_thread(self._metrics_endpoint.stop)
        if self.event_sinks is not None:
            await asyncio.to_thread(self.event_sinks.stop)
        self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
