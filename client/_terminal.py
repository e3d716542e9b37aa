"""Worker text made safe to print on a terminal.

A worker's output and failure messages are whatever its program wrote. Printed raw on a
terminal, escape sequences in them can move the cursor, rewrite what is shown, set the window
title, or (on some terminals) answer back as if typed. On a terminal `gelastic logs` and the
progress lines print them through this filter: escape sequences (CSI, OSC, DCS and the rest)
are removed, a carriage return becomes a newline, and every other control character (C0 but
newline and tab, DEL, C1, the bidirectional overrides) is removed. Piped or redirected output
is left byte for byte as it was.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["TerminalFilter", "strip_terminal_controls"]

MAX_PENDING = 4096
"""Longest unfinished escape sequence held back for the next chunk; past it, it is cut."""

_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: ESC [ parameters intermediates final
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC, DCS, SOS, PM, APC: until BEL or ST
    r"|\x1b[ -/]*[0-~]"  # any other escape: ESC intermediates final
    r"|\x9b[0-?]*[ -/]*[@-~]"  # the one-character (C1) forms of the same
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
)
_UNFINISHED = re.compile(
    r"(?:\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*\x1b?|[ -/]*)"
    r"|\x9b[0-?]*[ -/]*"
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*\x1b?"
    r"|\r)\Z"
)
_INTRODUCERS = re.compile(r"[\x1b\x90\x98\x9b\x9d\x9e\x9f\r][^\x1b\x90\x98\x9b\x9d\x9e\x9f\r]*\Z")
_LAST_STRING = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])"
    r"(?:[^\x07\x1b\x90\x98\x9c\x9d\x9e\x9f]|\x1b(?![\]PX^_]))*\Z"
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def strip_terminal_controls(text: str) -> str:
    """`text` without escape sequences or control characters but newline and tab."""
    text = _SEQUENCE.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", text)


class TerminalFilter:
    """strip_terminal_controls over a byte stream cut anywhere: a sequence or a UTF-8
    character split across two chunks is held back (MAX_PENDING at most) and joined."""

    def __init__(self, encoding: str = "utf-8") -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._encoding = encoding
        self._pending = ""

    def feed(self, data: bytes) -> bytes:
        text = self._pending + self._decoder.decode(data)
        self._pending = ""
        window = max(0, len(text) - MAX_PENDING)
        # Where an unfinished sequence may start: the last string sequence (its body may hold
        # the ESC of its terminator), else the last introducer of any kind.
        starts = [m.start() for m in (_LAST_STRING.search(text, window),) if m is not None]
        starts += [m.start() for m in (_INTRODUCERS.search(text, window),) if m is not None]
        for start in starts:
            if _UNFINISHED.fullmatch(text, start):
                self._pending, text = text[start:], text[:start]
                break
        return self._encode(strip_terminal_controls(text))

    def finish(self) -> bytes:
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return self._encode(strip_terminal_controls(text))

    def _encode(self, text: str) -> bytes:
        return text.encode(self._encoding, errors="replace")
