"""An event sink that never returns from its first event: the worst a site's sink can do."""

from __future__ import annotations

import threading
from typing import Any

_NEVER = threading.Event()


def hang(event: Any) -> None:
    _NEVER.wait()
