"""How many connections the coordinator's gRPC port holds, and for how long: its server options.

Every connection holds a file descriptor; a few hundred idle TCP connections used to take a
coordinator with 256 descriptors down. grpc core gives a server three bounds, all used here:

- `grpc.server_handshake_timeout_ms`: a connection has that long to finish TLS and send its
  HTTP/2 settings, or it is closed (grpc's default is two minutes);
- `grpc.max_connection_idle_ms`: a connection with no call open for that long gets a GOAWAY
  and is closed; a client reconnects by itself on its next call. An agent's session is a call
  open for the session's life, so it is never idle;
- `grpc.max_allowed_incoming_connections`: connections open at once; one more is closed as
  soon as it is accepted. This port's cap is the open-files limit less room for everything
  else the process holds (its store, logs, the dashboard's and the metrics' own caps), so the
  gRPC port alone cannot run the process out of descriptors.

The keepalive pings (every 10 s, 5 s to answer) close a connection whose peer no longer answers
at the HTTP/2 level.

Calls are admitted through a bounded queue, not refused. A call grpc core has read but the
server's loop has not taken yet waits in core's queue of pending calls: the loop takes them one
at a time, as fast as it can, and the callers wait on their open stream meanwhile (the
backpressure: an agent's hello is answered when the coordinator gets to it). grpc core's own
bounds (1,000 pending calls, then a random share refused, all refused past 3,000) turned away
thousands of the session attempts of 10,000 agents starting at once, each of which then came
back after a backoff; the queue here holds `MAX_PENDING_CALLS` and a call may wait
`MAX_UNTAKEN_S` in it. Past either the call is refused, and the agent retries as before.

There is no cap per peer: grpc core's connection quota passes the peer to its check but does not
use it, and grpcio's server offers no hook at accept. One host can therefore fill the cap; what
it holds is closed within the handshake timeout (a connection that never speaks HTTP/2), the
keepalive (one that stops answering) or the idle timeout (one that speaks but calls nothing),
connections already open (agents' sessions) are not touched, and the process never runs out of
descriptors. A firewall or a proxy in front is where a per-host limit belongs.
"""

from __future__ import annotations

import resource
from typing import Any

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "MAX_PENDING_CALLS",
    "MAX_UNTAKEN_S",
    "MIN_CONNECTIONS",
    "RESERVED_FILES",
    "connection_cap",
    "grpc_server_options",
    "open_files_limit",
]

DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
RESERVED_FILES = 128
"""Descriptors kept out of the gRPC cap for the rest of the process: the store, log files, the
etcd channels, the event loop's own, and the listening sockets."""
MIN_CONNECTIONS = 32
"""The cap never goes below this, however low the open-files limit."""
MAX_PENDING_CALLS = 65_536
"""Calls read and not yet taken by the server's loop: the admission queue's bound (a pending
call holds its stream's headers, a few kB)."""
MAX_UNTAKEN_S = 120
"""The longest a call may wait in that queue (grpc core's default is 30 s)."""
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def open_files_limit() -> int:
    """The soft limit on open files now in force (a large number where it is unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def connection_cap(open_files: int, reserved_elsewhere: int = 0) -> int:
    """gRPC connections open at once, for a process that may open `open_files` descriptors of
    which `reserved_elsewhere` are other listeners' caps (the dashboard's, the metrics')."""
    return max(MIN_CONNECTIONS, open_files - RESERVED_FILES - reserved_elsewhere)


def grpc_server_options(
    max_message_bytes: int,
    max_connections: int,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
) -> list[tuple[str, Any]]:
    """The coordinator's gRPC server options."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout * 1000))),
        ("grpc.max_connection_idle_ms", max(1, round(idle_timeout * 1000))),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", MAX_UNTAKEN_S),
    ]
