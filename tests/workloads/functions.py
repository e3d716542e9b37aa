"""Functions that tests run as worker entrypoints ("workloads.functions:<name>")."""

from __future__ import annotations

import os
import threading
from typing import Any


def return_dict(x: int, *, y: int = 1) -> dict[str, Any]:
    return {"x": x, "y": y, "rank": int(os.environ["RANK"]), "sum": x + y}


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def return_unpicklable() -> object:
    return threading.Lock()


def return_big(n: int) -> bytes:
    return b"x" * n


def exit_with(code: int) -> None:
    raise SystemExit(code)


def return_file_fifo() -> None:
    """Leave a FIFO where the bootstrap would write the return value, and end with exit code 0."""
    error_file = os.environ["TORCHELASTIC_ERROR_FILE"]
    os.mkfifo(os.path.join(os.path.dirname(error_file), "return.pkl"), 0o600)
    os._exit(0)
