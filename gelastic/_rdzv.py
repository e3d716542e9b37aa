"""The rendezvous of a multi-node `gelastic run`: torchrun's c10d, static and etcd forms.

Every node runs the same `gelastic run` line. This module decides, from that line and the
environment alone, what this node is: where the job's coordinator listens, whether this node
hosts it (c10d, static) or runs a replica of it (etcd), the node's name, and the key under which
every node submits the one job. It resolves names (done before any event loop starts) and
touches nothing else; the launcher (`gelastic._cli_run_nodes`) acts on what it says.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from client.model import is_host, is_name

__all__ = [
    "BACKENDS",
    "MultiNode",
    "RdzvConf",
    "RdzvError",
    "bind_address",
    "default_node_name",
    "endpoint_is_local",
    "parse_endpoint",
    "parse_rdzv_conf",
    "request_id_for",
]

BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
"""torchrun's built-in rendezvous backends; etcd-v2 is read as etcd."""
C10D_PORT = 29400
"""torchrun's port for a c10d endpoint given without one."""
STATIC_PORT = 29500
"""torchrun's MASTER_PORT when --master-port is not given."""
ETCD_PORT = 2379
MAX_CONF_CHARS = 4096
MAX_CONF_KEYS = 32
TOKEN_FILE_ENV = "GELASTIC_TOKEN_FILE"

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# torch's own keys that change nothing here (they tune its TCPStore rendezvous).
_TORCH_ONLY = frozenset(
    {
        "timeout",
        "read_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "store_type",
        "use_libuv",
        "protocol",
        "cacert",
        "etcd_prefix",
    }
)


class RdzvError(Exception):
    """A rendezvous setting that cannot work; reported as one line, exit code 2."""


@dataclass(frozen=True)
class RdzvConf:
    """`--rdzv-conf key=value,...`: torch's keys that mean something here, and ours."""

    is_host: bool | None = None
    """torch's knob: this node hosts the coordinator (None: guess from the endpoint)."""
    token_file: str = ""
    """The shared token every node's launcher presents (else `$GELASTIC_TOKEN_FILE`)."""
    join_timeout: float = 600.0
    """Seconds the job waits for min nodes; also how long a node waits for the coordinator."""
    last_call_timeout: float = 30.0
    """Seconds the round stays open for more nodes once min nodes have joined."""
    close_timeout: float = 30.0
    """Seconds the hosting launcher stays, after the job ended, for the other nodes to learn it."""
    leader_ttl: float = 5.0
    """etcd: seconds of the coordinator's leader lease (how soon a replica takes over)."""
    replica_port: int = 0
    """etcd: the port of this node's coordinator replica (0 = any free one)."""
    ignored: tuple[str, ...] = ()
    """torch's keys given that change nothing here."""


def _seconds(key: str, value: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise RdzvError(
            f"--rdzv-conf {key} must be a number of seconds, got {value!r:.40}"
        ) from None
    if not low <= number <= high:
        raise RdzvError(f"--rdzv-conf {key} must be {low:g}-{high:g} s, got {value:.40}")
    return number


def parse_rdzv_conf(text: str | None) -> RdzvConf:
    """Parse torchrun's `--rdzv-conf` ("k=v,k=v"); RdzvError names a bad entry."""
    raw = (text or "").strip()
    if len(raw) > MAX_CONF_CHARS:
        raise RdzvError(f"--rdzv-conf is longer than {MAX_CONF_CHARS} characters")
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        raw = raw[1:-1].strip()  # quotes a shell would have removed, passed on literally
    values: dict[str, str] = {}
    for item in raw.split(",") if raw else []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.fullmatch(key) or not value:
            raise RdzvError(f"--rdzv-conf: expected key=value, got {item.strip()[:60]!r}")
        values[key] = value
    if len(values) > MAX_CONF_KEYS:
        raise RdzvError(f"--rdzv-conf has more than {MAX_CONF_KEYS} keys")
    conf: dict[str, object] = {}
    ignored: list[str] = []
    for key, value in values.items():
        if key == "is_host":
            flag = value.lower()
            if flag not in _TRUE | _FALSE:
                raise RdzvError(f"--rdzv-conf is_host must be true or false, got {value!r:.40}")
            conf["is_host"] = flag in _TRUE
        elif key == "token_file":
            conf["token_file"] = value
        elif key in ("join_timeout", "last_call_timeout", "close_timeout"):
            conf[key] = _seconds(key, value, 0.0, 7 * 24 * 3600.0)
        elif key == "leader_ttl":
            conf[key] = _seconds(key, value, 1.0, 600.0)
        elif key == "replica_port":
            if not value.isdigit() or not 0 <= int(value) < 65536:
                raise RdzvError(f"--rdzv-conf replica_port must be 0-65535, got {value!r:.40}")
            conf[key] = int(value)
        elif key in _TORCH_ONLY:
            ignored.append(key)
        else:
            raise RdzvError(
                f"--rdzv-conf: unknown key {key!r}; known: is_host, token_file, join_timeout, "
                "last_call_timeout, close_timeout, leader_ttl, replica_port (and torch's "
                f"{', '.join(sorted(_TORCH_ONLY))}, which change nothing here)"
            )
    return RdzvConf(**conf, ignored=tuple(ignored))  # type: ignore[arg-type]


def parse_endpoint(text: str, default_port: int, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """(host, port) of HOST[:PORT] or [V6][:PORT]; RdzvError names the bad part."""
    value = text.strip()
    for scheme in ("http://", "etcd://"):
        if value.startswith(scheme):
            value = value[len(scheme) :]
    if value.startswith("https://"):
        raise RdzvError(f"{what}: https endpoints (TLS to etcd) are not supported here")
    value = value.rstrip("/")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise RdzvError(f"{what}: expected HOST[:PORT], got {text[:80]!r}")
        port_text = rest[1:]
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    else:
        host, port_text = value, ""
    if not host or not is_host(host):
        raise RdzvError(f"{what}: {host[:80]!r} is not a host name or IP address")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RdzvError(f"{what}: the port must be 1-65535, got {port_text[:20]!r}")
    return host, int(port_text)


def request_id_for(run_id: str) -> str:
    """The submit key every node of one run uses, so that all of them make one job."""
    if _RUN_ID.fullmatch(run_id):
        return f"rdzv.{run_id}"
    return "rdzv.h" + hashlib.sha256(run_id.encode("utf-8", "replace")).hexdigest()[:40]


def etcd_prefix_for(run_id: str) -> str:
    """The etcd key prefix of one run's coordinator replicas."""
    safe = run_id if _RUN_ID.fullmatch(run_id) else request_id_for(run_id)[5:]
    return f"gelastic-run/run-{safe}"  # never a store section's name (jobs, nodes, ...)


def job_name_for(run_id: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", run_id)[:100].lstrip("_.-")
    return name if is_name(name) else "run"


def default_node_name(env: Mapping[str, str], hostname: str, pid: int) -> str:
    """The host's short name plus what tells this launcher from others on the host.

    Under Slurm that is the task's `SLURM_PROCID` (two tasks of a step may share a host);
    elsewhere the launcher's pid.
    """
    base = re.sub(r"[^A-Za-z0-9_.\-]", "-", hostname.split(".")[0])[:100].lstrip("_.-") or "node"
    proc = env.get("SLURM_PROCID", "")
    suffix = proc if proc.isdigit() and len(proc) < 10 else str(pid)
    name = f"{base}-{suffix}"
    return name if is_name(name) else f"node-{pid}"


Resolver = Callable[[str], list[str]]


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _bindable(addr: str) -> bool:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
    except OSError:
        return False
    return True


def _host_names() -> set[str]:
    names = {"localhost"}
    with contextlib.suppress(OSError):
        name = socket.gethostname()
        names |= {name, name.split(".")[0]}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
    return {n.lower() for n in names if n}


def endpoint_is_local(
    host: str,
    *,
    resolve: Resolver = _resolve,
    bindable: Callable[[str], bool] = _bindable,
    names: set[str] | None = None,
) -> bool:
    """Whether HOST names this machine: its name, or an address one of its interfaces has.

    torch's c10d backend guesses its host the same way (`_matches_machine_hostname`).
    """
    if host.lower() in (names if names is not None else _host_names()):
        return True
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return True
    return any(bindable(addr) for addr in resolve(host))


def bind_address(
    host: str, *, resolve: Resolver = _resolve, bindable: Callable[[str], bool] = _bindable
) -> str:
    """Where a coordinator for HOST listens: the address HOST resolves to on this machine, or
    every interface when HOST is this machine's name but resolves elsewhere (a Kubernetes
    Service name, say)."""
    for addr in resolve(host):
        if bindable(addr):
            return addr
    return "0.0.0.0"


@dataclass(frozen=True)
class MultiNode:
    """What a multi-node `gelastic run` does on this node."""

    backend: str
    """c10d, static or etcd."""
    host: str
    """c10d and static: the coordinator's host; etcd: the etcd member's host."""
    port: int
    run_id: str
    conf: RdzvConf
    node_name: str
    token_file: str = ""
    node_rank: int | None = None
    """static: this node's --node-rank (rank 0 hosts the coordinator)."""
    local_addr: str = ""
    """The address other nodes reach this one at ("" = the one that routes to the endpoint)."""

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def request_id(self) -> str:
        return request_id_for(self.run_id)

    @property
    def etcd_store(self) -> str:
        return f"etcd://{self.endpoint}/{etcd_prefix_for(self.run_id)}"


def token_file_from(conf: RdzvConf, env: Mapping[str, str]) -> str:
    path = conf.token_file or env.get(TOKEN_FILE_ENV, "")
    if path and not os.path.isfile(path):
        raise RdzvError(f"the token file {path[:200]!r} does not exist (or is not a file)")
    return path
