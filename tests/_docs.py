"""Reading the docs as a test sees them: README.md and docs/*.md, their fenced blocks, their
inline code, and the `<!-- docs-test: skip (REASON) -->` markers before blocks.

A Python block runs in the docs test unless the line before its fence (blank lines aside) is
such a marker; the reason is required.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"( *)```([A-Za-z0-9_+-]*)[^`]*")
_MARKER = re.compile(r"<!-- docs-test: skip \((?P<reason>[^()]*[^()\s][^()]*)\) -->")
_ANY_MARKER = re.compile(r"<!--\s*docs-test.*")
_INLINE = re.compile(r"`([^`\n]+)`")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    """The block's lines, dedented to the fence's indentation."""
    skip: str | None
    """The marker's reason, or None when the block runs."""
    bad_marker: str | None = None
    """A `docs-test` comment before the block that is not a valid marker."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.fullmatch(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        before = lines[prev].strip() if prev >= 0 else ""
        marker = _MARKER.fullmatch(before)
        bad = before if marker is None and _ANY_MARKER.fullmatch(before) else None
        text = textwrap.dedent(
            "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in body)
        )
        out.append(
            Block(path, start + 1, lang, text, marker.group("reason") if marker else None, bad)
        )
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)]


def prose(path: Path) -> str:
    """The page without its fenced blocks (inline code is read from this)."""
    lines = path.read_text().splitlines()
    kept: list[str] = []
    inside = False
    for line in lines:
        if _FENCE.fullmatch(line) and (not inside or line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def inline_code(path: Path) -> list[str]:
    return _INLINE.findall(prose(path))
