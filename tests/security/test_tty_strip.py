"""Worker bytes printed on a terminal carry no escape sequence; piped, they are left as they are.

Before the fix `gelastic logs` and the progress lines wrote whatever a worker wrote: an OSC
sequence could set the terminal's title, CSI sequences move the cursor and rewrite lines.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import client.cli as cli
from client._client import _Progress
from client._terminal import MAX_PENDING, TerminalFilter, strip_terminal_controls
from protos.gelastic.v1 import gelastic_pb2 as pb

HOSTILE = (
    b"loss 0.5\n"
    b"\x1b]0;pwned title\x07"  # OSC: window title, BEL-terminated
    b"\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\"  # OSC 8 hyperlink, ST-terminated
    b"\x1b[2J\x1b[H"  # clear the screen, cursor home
    b"\x1b[31mred\x1b[0m\t"
    b"\x1bPqdcs\x1b\\"  # DCS
    b"\x1b(B"  # charset
    b"bell\x07 bs\x08 del\x7f c1\xc2\x9b31m nul\x00"
    b"\xe2\x80\xaeevil"  # U+202E right-to-left override
    b"\rbar\r\nend\xff\n"
)
CLEAN = "loss 0.5\nlinkred\tbell bs del c1 nulevil\nbar\nend\ufffd\n"


def test_strip_removes_sequences_and_controls_but_newline_and_tab() -> None:
    assert strip_terminal_controls(HOSTILE.decode("utf-8", "replace")) == CLEAN


def test_the_stream_filter_joins_what_chunks_cut() -> None:
    # Every cut point, including inside a sequence and inside a UTF-8 character.
    for cut in range(len(HOSTILE) + 1):
        f = TerminalFilter()
        out = f.feed(HOSTILE[:cut]) + f.feed(HOSTILE[cut:]) + f.finish()
        assert out.decode() == CLEAN, cut
    f = TerminalFilter()
    byte_by_byte = b"".join(f.feed(bytes([b])) for b in HOSTILE) + f.finish()
    assert byte_by_byte.decode() == CLEAN


def test_an_unfinished_sequence_is_held_back_at_most_max_pending() -> None:
    f = TerminalFilter()
    assert f.feed(b"ok \x1b]0;") == b"ok "
    out = f.feed(b"x" * (MAX_PENDING + 10))
    assert out.endswith(b"x" * MAX_PENDING)  # shown, not held for ever
    assert b"\x1b" not in out


@given(st.lists(st.binary(max_size=64), max_size=8))
def test_nothing_the_filter_writes_holds_a_control(chunks: list[bytes]) -> None:
    f = TerminalFilter()
    out = (b"".join(f.feed(c) for c in chunks) + f.finish()).decode()
    assert all(ch in "\n\t" or (ord(ch) >= 0x20 and not 0x7F <= ord(ch) <= 0x9F) for ch in out)
    assert not any(0x202A <= ord(ch) <= 0x202E or 0x2066 <= ord(ch) <= 0x2069 for ch in out)


class _Out(io.TextIOWrapper):
    def __init__(self, tty: bool) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8", write_through=True)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty

    def raw_bytes(self) -> bytes:
        self.flush()
        assert isinstance(self.buffer, io.BytesIO)
        return self.buffer.getvalue()


class _Job:
    def logs(self, rank: int, stream: str, attempt: int | None, follow: bool) -> Iterator[bytes]:
        # Cut in the middle of the sequences, as the transport may.
        yield from (HOSTILE[i : i + 7] for i in range(0, len(HOSTILE), 7))


class _Client:
    def job(self, job_id: str) -> _Job:
        return _Job()


def _logs_args() -> argparse.Namespace:
    return argparse.Namespace(job_id="j-1", rank=0, stream="stdout", attempt=None, follow=False)


@pytest.mark.parametrize("tty", [True, False])
def test_gelastic_logs_filters_on_a_terminal_only(
    tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _Out(tty)
    monkeypatch.setattr(cli.sys, "stdout", out)
    assert cli._cmd_logs(_Client(), _logs_args()) == cli.EXIT_OK  # type: ignore[arg-type]
    assert out.raw_bytes() == (CLEAN.encode() if tty else HOSTILE)


@pytest.mark.parametrize("tty", [True, False])
def test_progress_lines_filter_worker_text_on_a_terminal_only(tty: bool) -> None:
    out = _Out(tty)
    progress = _Progress(out)
    reason = "rank 0 failed: \x1b]0;pwned\x07boom\x1b[2J"
    update = pb.JobUpdate(
        job=pb.Job(job_id="j-1", state=pb.JOB_STATE_FAILED, reason=reason),
        events=[pb.Event(kind="worker_failed", reason=reason)],
    )
    progress.show(update)
    text = out.raw_bytes().decode()
    if tty:
        # Only the progress printer's own line control is there.
        assert text.count("\x1b") == text.count("\r\x1b[2K") == 2
        assert "pwned" not in text and "boom" in text
    else:
        assert text.count(reason) == 2
