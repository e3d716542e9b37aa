"""A worker's progress file is read by its agent, and the worker is not trusted: a link to
another file, a FIFO, a huge file or junk is never read as progress, and never hangs the
agent; the worker writes its own file 0600, never through a link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from client.progress import ProgressSample, _write
from nodeagent._progress_files import ProgressFiles


def test_a_link_in_place_of_the_progress_file_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"step": 7, "metrics": {"token": 1}}')
    path = tmp_path / "progress.json"
    path.symlink_to(secret)
    assert ProgressFiles("j", 1, [(0, 0, path)]).poll() is None


def test_a_fifo_in_place_of_the_progress_file_does_not_block_the_agent(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    os.mkfifo(path)
    assert ProgressFiles("j", 1, [(0, 0, path)]).poll() is None


def test_a_huge_progress_file_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    path.write_bytes(b'{"step": 1}' + b" " * (1 << 20))
    assert ProgressFiles("j", 1, [(0, 0, path)]).poll() is None


def test_the_worker_writes_0600_and_not_through_a_planted_link(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    _write(str(path), ProgressSample(3).to_json())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    os.symlink(target, f"{path}.{os.getpid()}.tmp")
    with pytest.raises(OSError):
        _write(str(path), ProgressSample(4).to_json())
    assert target.read_text() == "untouched"
