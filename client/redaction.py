"""What of a job spec may be shown: to clients, in events, in logs.

A spec carries what its workers need, secrets included (a token in env, `--password=...` in
argv). The agents get it whole in their assignments; everything else gets these views of it.
Pure functions on strings, so the coordinator's decision code and the wire adapter share them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["REDACTED", "describe_command", "redact_argv", "redact_env"]

REDACTED = "<redacted>"

# A name that looks like it holds a secret; fullmatch on the option or variable name alone.
_SECRET_NAME = re.compile(
    r"[\w.\-]*(?:token|pass|secret|key|credential|auth|cookie|private)[\w.\-]*",
    re.IGNORECASE,
)


def _is_secret_name(name: str) -> bool:
    return bool(name) and bool(_SECRET_NAME.fullmatch(name))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with the values of secret-looking options hidden.

    `--token=x` and `API_KEY=x` keep their name; in `--password x` the item after the option
    is hidden. Everything else is shown as it is.
    """
    out: list[str] = []
    hide_next = False
    for item in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = item.partition("=")
        bare = name.lstrip("-")
        if eq and _is_secret_name(bare):
            out.append(f"{name}={REDACTED}")
        elif not eq and item.startswith("-") and _is_secret_name(bare):
            out.append(item)
            hide_next = True
        else:
            out.append(item)
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Every variable's name, none of the values."""
    return dict.fromkeys(env, REDACTED)


def describe_command(command: Sequence[str], env_count: int) -> str:
    """The program and counts, for logs and events: never an argument or a value."""
    first = command[0] if command else ""
    # A whole command line in one item ("python x.py --token t") shows only its first word.
    words = first.split(maxsplit=1)
    program = (words[0] if words else first)[:200]
    args = len(command) - 1 + (1 if len(words) > 1 else 0)
    return f"{program!r} with {args} argument(s) and {env_count} env variable(s)"
