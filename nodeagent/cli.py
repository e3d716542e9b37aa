"""`nodeagent --coordinator HOST:PORT[,HOST:PORT...]`: run one node agent until SIGINT or SIGTERM."""

from __future__ import annotations

import sys

from client.version import VersionAction as _Version

# The agent never speaks TLS through Python's ssl module (grpc brings its own), yet asyncio
# imports it, mapping libcrypto into every agent: 4 MB of an idle agent's footprint. Keep it out
# of this process unless something already loaded it (or metrics are asked for; see main).
sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

from client.open_files import raise_open_files_limit  # noqa: E402
from nodeagent._launch import without_agent_secrets  # noqa: E402
from nodeagent.session import AgentConfig, NodeAgent  # noqa: E402

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    d = AgentConfig(coordinator="127.0.0.1:29400")
    p = argparse.ArgumentParser(prog="nodeagent", description="gelastic node agent")
    p.add_argument("--version", action=_Version)
    p.add_argument(
        "--coordinator",
        required=True,
        help="HOST:PORT of the coordinator, or of its replicas as a list A:PORT,B:PORT,... "
        "(at most 16; the agent follows the leader among them)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=d.slots,
        help="worker processes this node may run (default: one per offered GPU, or the CPU "
        "count on a node without GPUs)",
    )
    p.add_argument(
        "--gpus",
        default=d.gpus,
        help="NVIDIA GPUs to offer: auto (every GPU NVML sees; none without nvidia-ml-py or a "
        "driver), none, or NVML indices such as 0,1,2,3 (default %(default)s)",
    )
    p.add_argument("--name", default=d.name, help="unique node name (default: host name)")
    p.add_argument(
        "--addr",
        default="",
        help="address peers use to reach this node (default: the one routing to the coordinator)",
    )
    p.add_argument(
        "--log-dir",
        default="",
        help="worker log directory, 0700 (default: ~/.local/state/gelastic/agent-NAME/logs, "
        "as root /var/lib/gelastic/agent-NAME/logs)",
    )
    p.add_argument(
        "--state-dir",
        default="",
        help="where the worker pid file and the node secret live; keep it across restarts "
        "(default: --log-dir)",
    )
    p.add_argument(
        "--reconnect-max",
        type=float,
        default=d.reconnect_max,
        help="longest pause between reconnect attempts, in seconds (default %(default)s)",
    )
    p.add_argument(
        "--token-file",
        default="",
        help="token the coordinator expects from agents; read once at start and never passed "
        "to workers, so the file may be removed once the agent has started",
    )
    p.add_argument(
        "--tls-ca", default="", help="PEM CA of the coordinator's certificate (enables TLS)"
    )
    p.add_argument("--tls-cert", default="", help="PEM client certificate (mTLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-server-name", default="", help="name to check in the coordinator's certificate"
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="use TLS without --tls-ca: verify the coordinator against the system trust store",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow sending the token in plain text to a coordinator off this host",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics over HTTP on this port (default 0 = off)",
    )
    p.add_argument(
        "--metrics-host",
        default=d.metrics_host,
        help="address to serve the metrics on (default %(default)s)",
    )
    p.add_argument(
        "--stop-grace",
        type=float,
        default=None,
        help="most seconds to let workers stop when the agent is asked to exit (SIGTERM, "
        "SIGINT, SIGHUP): the node is drained, so its jobs re-form on the other nodes without "
        "spending a restart; their workers get a preemption notice, SIGTERM their job's "
        "stop_grace before this deadline and SIGKILL at it, and the agent exits once they are "
        "gone (default: each job's stop_grace)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE:OBJECT",
        help="load a site plug-in with hooks before_round, after_worker_exit and health_check; "
        "repeatable (docs/extending.md)",
    )
    p.add_argument(
        "--plugin-timeout",
        type=float,
        default=d.plugin_timeout,
        help="seconds a plug-in hook may take before it is ignored (default %(default)s)",
    )
    p.add_argument(
        "--health-check-interval",
        type=float,
        default=d.health_check_interval,
        help="seconds between two health checks of the plug-ins (default %(default)s)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def _scrub_token(token_file: str, token: str) -> None:
    """Keep the agent's token, and the path of its file, out of every process it starts.

    Workers (and the sentinel) start from this process's environment; the token itself is
    held in memory only, read once at start.
    """
    secrets = [token]
    if token_file:
        secrets += [os.path.abspath(token_file), os.path.realpath(token_file)]
        if os.sep in token_file:
            secrets.append(token_file)
    keep = without_agent_secrets(os.environ, secrets)
    for name in [k for k in os.environ if k not in keep]:
        del os.environ[name]


async def _run(config: AgentConfig, grace: float | None) -> str:
    """Run the agent until a signal (""), or until the coordinator refuses it for good (why)."""
    # Each worker holds a few pipes, each log relay and metrics scrape one descriptor. Workers
    # inherit the raised soft limit (a DataLoader sharing tensors by descriptor needs it too).
    raise_open_files_limit()
    agent = NodeAgent(config)
    _scrub_token(config.token_file, agent.security.token)
    await agent.start()
    print(
        f"nodeagent {config.name} ({agent.addr}) -> {','.join(agent.coordinators)}; logs in {agent.log_root}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    waits = [loop.create_task(stop.wait()), loop.create_task(agent.refused.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waits:
            t.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        await agent.stop(grace, leave_first=True)
    return agent.refusal


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    uses_tls = args.tls or args.tls_cert or args.tls_ca
    if (args.metrics_port or uses_tls) and sys.modules.get("ssl", False) is None:
        # prometheus_client imports ssl, the system trust store is found through it, and the
        # TLS files are checked with it at start: with metrics on, or TLS, let it load after all.
        del sys.modules["ssl"]
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{args.name}] %(name)s: %(message)s",
    )
    config = AgentConfig(
        coordinator=args.coordinator,
        slots=args.slots,
        gpus=args.gpus,
        name=args.name,
        addr=args.addr,
        log_dir=args.log_dir,
        state_dir=args.state_dir,
        reconnect_max=args.reconnect_max,
        token_file=args.token_file,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        tls=args.tls,
        insecure=args.insecure,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        plugins=tuple(args.plugin),
        plugin_timeout=args.plugin_timeout,
        health_check_interval=args.health_check_interval,
    )
    try:
        config.validate()
        refusal = asyncio.run(_run(config, args.stop_grace))
    except (ValueError, OSError) as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(f"nodeagent: {refusal}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
