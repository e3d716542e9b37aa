"""`client.preempted()`: None outside gelastic and before a notice, the notice once its file is
there, read again only when the file changes, and nothing from a file that is not a notice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from client import preempt
from client.preempt import PREEMPT_FILE_ENV, PreemptNotice, notice_json, preempted


@pytest.fixture
def notice_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "preempt-n0.json"
    monkeypatch.setenv(PREEMPT_FILE_ENV, str(path))
    monkeypatch.setattr(preempt, "_cache", None)
    return path


def test_outside_gelastic_there_is_no_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREEMPT_FILE_ENV, raising=False)
    assert preempted() is None


def test_the_notice_appears_with_its_file_and_is_read_once(notice_path: Path) -> None:
    assert preempted() is None
    notice_path.write_bytes(notice_json(1234.5, "node-1", "spot reclaim"))
    assert preempted() == PreemptNotice(1234.5, "node-1", "spot reclaim")
    assert preempted().seconds_left(now=1200.0) == 34.5  # type: ignore[union-attr]
    with mock.patch.object(preempt, "_read", side_effect=AssertionError("read again")):
        assert preempted() == PreemptNotice(1234.5, "node-1", "spot reclaim")


def test_a_rewritten_notice_is_read_again(notice_path: Path) -> None:
    notice_path.write_bytes(notice_json(10.0, "a", "first"))
    assert preempted().reason == "first"  # type: ignore[union-attr]
    tmp = notice_path.with_name("tmp")
    tmp.write_bytes(notice_json(20.0, "a", "second, sooner"))
    os.replace(tmp, notice_path)
    assert preempted() == PreemptNotice(20.0, "a", "second, sooner")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[]",
        b'{"node": "x"}',
        b'{"deadline": "soon"}',
        b'{"deadline": NaN}',
        b'{"deadline": 1, "node": 3}',
        b" " * (70 * 1024),
    ],
)
def test_a_file_that_is_not_a_notice_is_none(notice_path: Path, content: bytes) -> None:
    notice_path.write_bytes(content)
    assert preempted() is None


def test_a_worker_imports_it_without_grpc() -> None:
    code = "import sys, client; client.preempted(); print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
