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


# A shell word of a command line in one string: quoted parts and unquoted characters.
_WORD = re.compile(r"""(?:"(?:[^"\\]|\\.)*"?|'[^']*'?|\\.|[^\s"'\\])+""")
_MAX_NESTING = 4
"""`sh -c "bash -c '...'"`: command lines inside command lines are read this deep; a deeper
one is withheld whole."""


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with the values of secret-looking options hidden.

    `--token=x` and `API_KEY=x` keep their name; in `--password x` the item after the option
    is hidden; `-pSECRET` (a password given to `-p`, as mysql takes it) keeps `-p`. An item
    that is a whole command line (`sh -c "train --password=x"`) is read word by word with the
    same rules. Everything else is shown as it is.
    """
    return _redact_items(list(argv), _MAX_NESTING)


def _redact_items(items: list[str], depth: int) -> list[str]:
    out: list[str] = []
    hide_next = False
    for item in items:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = item.partition("=")
        bare = name.lstrip("-")
        if eq and not any(c.isspace() for c in name) and _is_secret_name(bare):
            out.append(f"{name}={REDACTED}")
        elif item.startswith("-p") and len(item) > 2 and (not eq or name == "-p"):
            # -pSECRET or -p=SECRET. Whether `-psecret` is that or an option named "psecret"
            # (`-password x`) cannot be told: both are hidden, and so is the next item then.
            out.append(f"-p={REDACTED}" if eq else f"-p{REDACTED}")
            hide_next = not eq and _is_secret_name(bare)
        elif not eq and item.startswith("-") and _is_secret_name(bare):
            out.append(item)
            hide_next = True
        elif any(c.isspace() for c in item):
            # Deeper than anyone nests shells on purpose: shown as nothing rather than read.
            out.append(_redact_line(item, depth - 1) if depth > 0 else REDACTED)
        else:
            out.append(item)
    return out


def _unquote(word: str) -> str:
    """What the shell makes of one word (its quotes and backslashes removed)."""
    out: list[str] = []
    i = 0
    while i < len(word):
        c = word[i]
        if c == "'":
            end = word.find("'", i + 1)
            end = len(word) if end < 0 else end
            out.append(word[i + 1 : end])
            i = end + 1
        elif c == '"':
            i += 1
            while i < len(word) and word[i] != '"':
                if word[i] == "\\" and i + 1 < len(word):
                    i += 1
                out.append(word[i])
                i += 1
            i += 1
        elif c == "\\" and i + 1 < len(word):
            out.append(word[i + 1])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _redact_line(line: str, depth: int) -> str:
    """A command line in one string, with each word that `_redact_items` would hide hidden."""
    spans = [(m.start(), m.end()) for m in _WORD.finditer(line)]
    words = [_unquote(line[a:b]) for a, b in spans]
    shown = _redact_items(words, depth)
    parts: list[str] = []
    last = 0
    for (a, b), word, new in zip(spans, words, shown, strict=True):
        parts.append(line[last:a])
        parts.append(line[a:b] if new == word else _requote(new))
        last = b
    parts.append(line[last:])
    return "".join(parts)


def _requote(word: str) -> str:
    # A word that was a nested command line keeps its spaces: quote it again, as the shell would.
    return f"'{word}'" if any(c.isspace() for c in word) and "'" not in word else word


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
