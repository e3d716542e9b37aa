"""Plug-ins of a make-believe site, loaded by name (`module:object`) in the plug-in tests."""

from __future__ import annotations

import threading
from typing import Any

RECEIVED: list[Any] = []
"""Every job event `record` was given, in order."""


def record(event: Any) -> None:
    RECEIVED.append(event)


class Blocked:
    """An event sink that hangs until `release` is set."""

    release = threading.Event()

    def __init__(self) -> None:
        self.events: list[Any] = []

    def emit(self, event: Any) -> None:
        self.release.wait(30)
        self.events.append(event)


class Veto:
    """A health check before each round: this host's scratch disk is full."""

    def before_round(self, info: Any) -> str:
        return f"scratch disk full on {info.node} (ranks {list(info.global_ranks)})"


class Sick:
    """A periodic health check that fails."""

    def health_check(self) -> str:
        return "ECC errors on the NIC"


class Broken:
    """Every hook misbehaves: one raises, one hangs past the timeout, one returns nonsense."""

    exits: list[Any] = []
    hang = threading.Event()

    def before_round(self, info: Any) -> None:
        raise RuntimeError("the check itself is broken")

    def after_worker_exit(self, info: Any) -> None:
        self.exits.append(info)
        self.hang.wait(30)  # past the agent's timeout: ignored, the agent goes on

    def health_check(self) -> object:
        return {"not": "a reason"}
