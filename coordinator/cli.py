"""`coordinator serve`: run the coordinator until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from client.open_files import raise_open_files_limit
from client.version import VersionAction as _Version
from coordinator._dashboard_guard import AcceptErrorLog
from coordinator.server import Coordinator, CoordinatorConfig

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description="gelastic coordinator")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the coordinator")
    d = CoordinatorConfig()
    s.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    s.add_argument(
        "--port", type=int, default=d.port, help="port (0 = any free; default %(default)s)"
    )
    s.add_argument(
        "--heartbeat-interval",
        type=float,
        default=d.heartbeat_interval,
        help="seconds between agent heartbeats (default %(default)s)",
    )
    s.add_argument(
        "--lease",
        type=float,
        default=d.lease,
        help="seconds of silence after which a node is lost (default %(default)s)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback address without a token, or with a token but without TLS, "
        "and an etcd store off loopback without TLS",
    )
    s.add_argument(
        "--state-dir",
        default=d.state_dir,
        help="durable state directory, or :memory: (default %(default)s)",
    )
    s.add_argument(
        "--store",
        default=d.store,
        help="where the state lives: sqlite (in --state-dir, the default) or "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
    )
    s.add_argument("--etcd-ca", default="", help="PEM CA of the etcd members (TLS to etcd)")
    s.add_argument("--etcd-cert", default="", help="PEM client certificate for etcd")
    s.add_argument("--etcd-key", default="", help="PEM private key of --etcd-cert")
    s.add_argument("--etcd-user", default="", help="etcd user to authenticate as")
    s.add_argument("--etcd-password-file", default="", help="file holding --etcd-user's password")
    s.add_argument(
        "--advertise",
        default=d.advertise,
        metavar="HOST:PORT",
        help="with --store etcd://: the address agents and clients reach this replica at "
        "(default: the address it listens on)",
    )
    s.add_argument(
        "--leader-ttl",
        type=float,
        default=d.leader_ttl,
        metavar="SECONDS",
        help="with --store etcd://: the leader lease; a leader that cannot refresh it steps "
        "down before it expires, and a standby takes over (1-60, default %(default)g)",
    )
    s.add_argument(
        "--retain-jobs",
        type=int,
        default=d.retain_jobs,
        help="finished jobs kept with their events and results (default %(default)s)",
    )
    s.add_argument(
        "--retain-seconds",
        type=float,
        default=d.retain_seconds,
        help="how long finished jobs and gone nodes are kept (default %(default)s = 7 days)",
    )
    s.add_argument(
        "--lost-node-retention",
        type=float,
        default=d.lost_node_retention,
        metavar="SECONDS",
        help="how long a lost node stays in the node list (default %(default)g = 24 h; at most "
        "the --retain-seconds; `gelastic nodes --forget NAME` drops one at once)",
    )
    s.add_argument(
        "--quarantine-ttl",
        type=float,
        default=d.quarantine_ttl,
        metavar="SECONDS",
        help="how long a node with a lost GPU, or one with new uncorrectable ECC errors, takes "
        "no new rounds (default %(default)g = 1 h; `gelastic nodes --clear-quarantine NAME` "
        "ends it at once)",
    )
    s.add_argument(
        "--flaky-rounds",
        type=int,
        default=d.flaky_rounds,
        metavar="N",
        help="quarantine a node (for --quarantine-ttl) once N rounds of several nodes failed "
        "first on it, while their other nodes were healthy, within --flaky-window (default "
        "%(default)d; 0 = never)",
    )
    s.add_argument(
        "--flaky-window",
        type=float,
        default=d.flaky_window,
        metavar="SECONDS",
        help="the window of --flaky-rounds (default %(default)g = 10 min)",
    )
    s.add_argument(
        "--start-timeout",
        type=float,
        default=d.start_timeout,
        help="seconds a node has from a round's assignment until all its workers started; "
        "past it the round fails (default %(default)s)",
    )
    s.add_argument(
        "--reconnect-grace",
        type=float,
        default=d.reconnect_grace,
        help="seconds known nodes have to reconnect after a restart (default %(default)s)",
    )
    s.add_argument("--token-file", default="", help="shared token agents and clients must present")
    s.add_argument("--agent-token-file", default="", help="a separate token for agents")
    s.add_argument("--client-token-file", default="", help="a separate token for clients")
    s.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS")
    s.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    s.add_argument(
        "--tls-client-ca", default="", help="require client certificates signed by this CA (mTLS)"
    )
    s.add_argument(
        "--require-cert-node-names",
        action="store_true",
        help="with mTLS: an agent's --name must be a DNS name (or the CN) of its certificate",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics over HTTP on this port (default 0 = off)",
    )
    s.add_argument(
        "--metrics-host",
        default=d.metrics_host,
        help="address to serve the metrics on (default %(default)s)",
    )
    s.add_argument(
        "--event-sink",
        action="append",
        default=[],
        metavar="MODULE:OBJECT",
        help="also send every job event to this plug-in (an object with emit(event), or a "
        "callable), or to jsonl:/path; repeatable (docs/extending.md)",
    )
    s.add_argument(
        "--event-log",
        default="",
        metavar="FILE",
        help="append every job event to this JSON-lines file (created 0600, rotated at 64 MiB, "
        "3 kept)",
    )
    s.add_argument(
        "--dashboard-port",
        type=int,
        default=d.dashboard_port,
        help="serve the web dashboard on this port of --host, with the client token and TLS "
        "of the gRPC port (default 0 = off)",
    )
    s.add_argument(
        "--dashboard-without-token",
        action="store_true",
        help="serve the dashboard even without a client token, to anyone who can reach it "
        "(without this flag it refuses to start)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="gRPC connections open at once; more are closed at their accept (default 0 = "
        "the open-files limit less room for the rest of the process)",
    )
    s.add_argument(
        "--handshake-timeout",
        type=float,
        default=d.handshake_timeout,
        help="seconds a new gRPC connection has to finish TLS and start HTTP/2 "
        "(default %(default)s)",
    )
    s.add_argument(
        "--connection-idle-timeout",
        type=float,
        default=d.connection_idle_timeout,
        help="seconds a gRPC connection with no call open may stay (default %(default)s)",
    )
    s.add_argument(
        "--port-file", default="", help="write the port actually bound to this file once listening"
    )
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


async def _serve(config: CoordinatorConfig, port_file: str) -> None:
    raise_open_files_limit()
    # Out of descriptors, asyncio reports a failed accept once a second per listening socket.
    asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
    coord = Coordinator(config)
    await coord.start()
    # The state is long-lived and grows with the cluster: keep the collector from sweeping all
    # of it again and again (full collections dominated a 5,000-node rendezvous).
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(f"{coord.port}\n")
        import os

        os.replace(port_file + ".tmp", port_file)
    print(f"coordinator listening on {coord.address}", flush=True)
    if coord.dashboard is not None:
        print(f"dashboard on {coord.dashboard.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await coord.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = CoordinatorConfig(
        host=args.host,
        port=args.port,
        heartbeat_interval=args.heartbeat_interval,
        lease=args.lease,
        insecure=args.insecure,
        state_dir=args.state_dir,
        store=args.store,
        etcd_ca=args.etcd_ca,
        etcd_cert=args.etcd_cert,
        etcd_key=args.etcd_key,
        etcd_user=args.etcd_user,
        etcd_password_file=args.etcd_password_file,
        advertise=args.advertise,
        leader_ttl=args.leader_ttl,
        reconnect_grace=args.reconnect_grace,
        retain_jobs=args.retain_jobs,
        retain_seconds=args.retain_seconds,
        lost_node_retention=args.lost_node_retention,
        start_timeout=args.start_timeout,
        quarantine_ttl=args.quarantine_ttl,
        flaky_rounds=args.flaky_rounds,
        flaky_window=args.flaky_window,
        token_file=args.token_file,
        agent_token_file=args.agent_token_file,
        client_token_file=args.client_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        require_cert_node_names=args.require_cert_node_names,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        event_sinks=tuple(args.event_sink),
        event_log=args.event_log,
        dashboard_port=args.dashboard_port,
        dashboard_without_token=args.dashboard_without_token,
        max_connections=args.max_connections,
        handshake_timeout=args.handshake_timeout,
        connection_idle_timeout=args.connection_idle_timeout,
    )
    try:
        config.validate()
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config, args.port_file))
    except (OSError, ValueError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
