"""The client's channels: one per listed coordinator replica, made when first used.

Each channel is made with the client's `Security` (the TLS name checked is the host dialed, or
--tls-server-name for all) and the message limits of gelastic's messages; a list of several
replicas reconnects sooner, so that a replica that comes back is noticed within seconds.
"""

from __future__ import annotations

import threading
from typing import TypeAlias

import grpc

from client.model import GelasticError
from client.security import Security
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

__all__ = ["LIST_CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "ReplicaChannels", "Stub"]

LIST_CHANNEL_OPTIONS = (
    # A replica that comes back (or a black-holed one) is noticed within seconds, not the
    # default 20 s connect timeout and 120 s backoff of a channel that failed.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 3000),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CLIENT_IDLE_MS = 50_000
"""A channel with no call open this long lets its connection go (and makes a new one on its
next call) before the coordinator closes it as idle (after 60 s, its default), which grpc
would log on the client's stderr."""

Stub: TypeAlias = pb_grpc.CoordinatorStub


class ReplicaChannels:
    """The channel and stub of each replica address, made on first use; thread-safe. Once
    closed, every channel is closed and no new one is made."""

    def __init__(self, security: Security, *, several: bool) -> None:
        self.security = security
        self._options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.client_idle_timeout_ms", CLIENT_IDLE_MS),
        ]
        if several:
            self._options.extend(LIST_CHANNEL_OPTIONS)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Stub] = {}
        self._closed = False

    def stub(self, address: str) -> Stub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                if self._closed:
                    raise GelasticError(None, "the client is closed")
                # The TLS name checked is the host dialed (or --tls-server-name for all).
                channel = self.security.channel(address, options=self._options)
                self._channels[address] = channel
                stub = self._stubs[address] = Stub(channel)
            return stub

    def channel(self, address: str) -> grpc.Channel:
        self.stub(address)
        return self._channels[address]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for channel in channels:
            channel.close()
