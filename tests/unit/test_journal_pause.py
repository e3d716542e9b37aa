"""The journal's pause after a costly write (in proportion to its cost, so that writing a big
job never takes most of the loop) ends once a message to a node waits on the next write."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from coordinator import _journal
from coordinator._cluster import JobChanged
from coordinator._journal import Journal
from coordinator._node_sessions import _Session
from coordinator._store import Store
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests.unit.test_member_rows import _job


class _Clock:
    """`time` for the journal: every flush seems to cost a minute of CPU."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        self.t += 30.0
        return self.t

    def process_time(self) -> float:
        return self.t


async def test_a_message_held_after_a_costly_write_ends_the_pause_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(str(tmp_path))
    d = _job(4)
    journal = Journal(store, d.cluster, fenced=lambda why: None)
    monkeypatch.setattr(_journal, "time", _Clock())
    saved = asyncio.Event()
    real = journal.flush

    async def flush() -> None:
        await real()
        saved.set()

    monkeypatch.setattr(journal, "flush", flush)
    loop = asyncio.create_task(journal.flush_loop())
    try:
        journal.record([JobChanged("j")])
        journal.flush_wanted.set()
        await asyncio.wait_for(saved.wait(), 5.0)
        # Decided after that write (the master port came back): an Assign waits on the next.
        session = _Session("n0", "inc")
        d.exit("n1", 0)
        journal.record([JobChanged("j")])
        journal.send_after_write(session, pb.CoordinatorMessage())
        journal.flush_wanted.set()
        await asyncio.wait_for(session.outbox.get(), 5.0)  # not after a 4-minute pause
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
