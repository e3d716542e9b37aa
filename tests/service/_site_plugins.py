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

