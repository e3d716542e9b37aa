"""What the coordinator keeps on disk is readable by its own user only.

Before the fix the state dir kept whatever mode it had (an existing 0755 dir stayed 0755) and
SQLite created coordinator.sqlite3 and its -wal/-shm with the process umask (0644 under the usual
022): every local user could read every job's spec and env.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator._store import Store


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_state_dir_and_its_database_files_are_private(
    tmp_path: Path, usual_umask: None
) -> None:
    state = tmp_path / "a" / "state"
    store = Store(str(state))
    try:
        assert _mode(state) == 0o700
        db = state / "coordinator.sqlite3"
        assert _mode(db) == 0o600
        for suffix in ("-wal", "-shm"):
            side = Path(str(db) + suffix)
            assert side.exists()  # the schema is written in WAL mode: both are there
            assert _mode(side) == 0o600
    finally:
        store.close()


def test_an_existing_open_state_dir_and_database_are_tightened(
    tmp_path: Path, usual_umask: None
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    Store(str(state)).close()
    db = state / "coordinator.sqlite3"
    os.chmod(db, 0o644)
    store = Store(str(state))
    try:
        assert _mode(state) == 0o700
        assert _mode(db) == 0o600
        assert all(
            _mode(p) == 0o600 for p in state.iterdir() if p.name.startswith("coordinator.sqlite3")
        )
    finally:
        store.close()


def test_a_database_path_that_is_a_symlink_is_refused(tmp_path: Path, usual_umask: None) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    (state / "coordinator.sqlite3").symlink_to(target)
    with pytest.raises(OSError):
        Store(str(state))
    assert not target.exists()
