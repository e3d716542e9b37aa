"""How two job specs differ, in words a user can act on, with nothing secret shown.

When every node of a multi-node `gelastic run` submits the job under one key, a node whose
command line differs is refused with these lines: "args: ['--lr', '1'] here, ['--lr', '2'] in
the job". Argument values that look secret are redacted, env values are never shown, and
pickled payloads are named, not printed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from client.model import JobSpec
from client.redaction import redact_argv

__all__ = ["spec_differences"]

MAX_SHOWN = 160
"""Characters of one value shown; longer ones are cut."""
MAX_FIELDS = 8
"""Fields named; more are counted."""
_OPAQUE = frozenset({"function_args", "result_key", "kwargs"})


def _shown(name: str, value: Any) -> str:
    if name in _OPAQUE:
        return f"<{len(value) if isinstance(value, (bytes, Mapping)) else '?'} bytes/items>"
    if name == "env" and isinstance(value, Mapping):
        return "{" + ", ".join(sorted(str(k) for k in value)) + "} (values not shown)"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        value = redact_argv([str(v) for v in value])
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def spec_differences(mine: JobSpec, theirs: JobSpec) -> list[str]:
    """One line per field in which `mine` differs from `theirs` ("F: X here, Y in the job")."""
    out: list[str] = []
    for f in fields(JobSpec):
        a, b = getattr(mine, f.name), getattr(theirs, f.name)
        if a == b:
            continue
        if (
            f.name == "env"
            and isinstance(a, Mapping)
            and isinstance(b, Mapping)
            and set(a) == set(b)
        ):
            out.append("env: the values of some variables differ (not shown)")
        else:
            out.append(f"{f.name}: {_shown(f.name, a)} here, {_shown(f.name, b)} in the job")
    if len(out) > MAX_FIELDS:
        out = [*out[:MAX_FIELDS], f"and {len(out) - MAX_FIELDS} more fields"]
    return out
