"""The SQLite store keeps a big job's round members as rows of their own: a write of a
`JobRecord` writes the job's head and only the members it names as changed, and `load` gives
back the whole document; a job whose member rows do not fit it is set aside, not loaded."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from coordinator._cluster import JobChanged
from coordinator._journal import Journal
from coordinator._store import MEMBERS_APART, JobRecord, Store
from tests.unit._cluster_driver import Driver


def _job(nodes: int) -> Driver:
    d = Driver()
    for i in range(nodes):
        d.connect(f"n{i}")
    d.submit("j", min_nodes=2, max_nodes=nodes, last_call_timeout=0, max_restarts=1)
    d.settle()
    return d


def _save(store: Store, d: Driver, record: JobRecord | None = None) -> JobRecord:
    record = record or d.cluster.job_record("j")
    store.save([("j", 1.0, d.cluster.job_state("j").value, record)], [])
    return record


def _loaded(store: Store) -> dict[str, Any]:
    (doc,) = store.load().jobs
    return doc


def _dumped(d: Driver) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(d.cluster.dump_job("j")))
    return doc


def _rows(path: Path) -> list[tuple[int, str]]:
    db = sqlite3.connect(path / "coordinator.sqlite3")
    try:
        return list(db.execute("SELECT idx, data FROM members ORDER BY idx"))
    finally:
        db.close()


def test_a_record_writes_only_the_members_it_names_and_loads_whole(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    d = _job(4)
    _save(store, d)
    assert _loaded(store) == _dumped(d)
    before = _rows(tmp_path)
    d.exit("n2", 0)
    record = d.cluster.job_record("j")
    assert record.changed == {2}
    _save(store, d, record)
    after = _rows(tmp_path)
    assert [r for r in after if r not in before] == [(2, record.members[2])]
    assert _loaded(store) == _dumped(d)
    # What is on disk is the record's: a member left out of `changed` keeps its old row.
    _save(store, d, JobRecord(record.before, record.members, record.after, frozenset()))
    assert _rows(tmp_path) == after


def test_a_smaller_round_drops_the_rows_past_it_and_a_whole_document_drops_all(
    tmp_path: Path,
) -> None:
    store = Store(str(tmp_path))
    d = _job(4)
    _save(store, d)
    d.disconnect("n3")
    d.settle()
    _save(store, d)
    assert len(_rows(tmp_path)) == 3
    assert _loaded(store) == _dumped(d)
    store.save([("j", 1.0, "RUNNING", d.cluster.dump_job("j"))], [])
    assert _rows(tmp_path) == []
    assert _loaded(store) == _dumped(d)
    store.save([], [], forget_jobs=["j"])
    assert store.load().jobs == []


def test_a_job_whose_member_rows_do_not_fit_is_set_aside(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    d = _job(3)
    _save(store, d)
    store.close()
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    with db:
        db.execute("DELETE FROM members WHERE idx=1")
    db.close()
    store = Store(str(tmp_path))
    assert store.load().jobs == []
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    try:
        moved = sorted(r[0] for r in db.execute("SELECT source FROM quarantine"))
        left = db.execute("SELECT count(*) FROM members").fetchone()[0]
    finally:
        db.close()
    assert moved == ["jobs", "members", "members"] and left == 0


def test_a_job_written_whole_before_member_rows_existed_still_loads(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    d = _job(3)
    doc = d.cluster.dump_job("j")
    store.save([("j", 1.0, "RUNNING", doc)], [])
    loaded = _loaded(store)
    assert MEMBERS_APART not in loaded and loaded == _dumped(d)


class _FailingStore(Store):
    """Fails the next save when `fail` is set."""

    fail = False

    def save(self, jobs: Any, *args: Any, **kwargs: Any) -> None:
        if self.fail:
            self.fail = False
            raise OSError("disk full")
        super().save(jobs, *args, **kwargs)


async def test_members_of_a_failed_write_are_written_by_the_next(tmp_path: Path) -> None:
    store = _FailingStore(str(tmp_path))
    d = _job(4)
    journal = Journal(store, d.cluster, fenced=lambda why: None)
    journal.record([JobChanged("j")])
    await journal.flush()
    d.exit("n2", 0)
    journal.record([JobChanged("j")])
    store.fail = True
    with pytest.raises(OSError):
        await journal.flush()
    await journal.flush()  # nothing changed since: the record names member 2 again
    assert _loaded(store) == _dumped(d)
