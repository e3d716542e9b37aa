"""The service stops however its flush loop is caught: even when the wake-up of its batching
pause lands in the same moment as the cancel, and when the cancel lands in the middle of a write
(the stop waits for that write, then writes what is left).

(`asyncio.wait_for` on Python 3.11 returns the inner result instead of raising when the inner
wait finishes in the very step the outer task is cancelled: a loop built on it then never ends.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator import _journal
from coordinator._service import CoordinatorService
from coordinator._store import Store

ROUNDS = 200


async def test_stop_ends_the_flush_loop_even_when_a_wake_up_races_the_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long batching pause, so that a slow flush on a busy machine still leaves one to catch.
    monkeypatch.setattr(_journal, "FLUSH_INTERVAL_S", 30.0)
    for _ in range(ROUNDS):
        svc = CoordinatorService(store=Store(":memory:"))
        svc.start()
        task = svc._flush_task
        assert task is not None
        svc.journal.flush_wanted.set()
        # Let the loop flush (nothing to write) and reach its batching pause: it waits on
        # `urgent` then.
        for _ in range(5000):
            if svc.journal.urgent._waiters:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.001)
        assert svc.journal.urgent._waiters  # type: ignore[attr-defined]
        # The wake-up lands, and the cancel (as stop() sends it) comes in the very next step.
        svc.journal.urgent.set()
        await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done, "the flush loop went on after it was cancelled"
        assert task.cancelled()
        await asyncio.wait_for(svc.stop(), 5)


class _HeldStore(Store):
    """A store whose first write waits until the test lets it go (in the write's thread)."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(state_dir)
        self.writing = threading.Event()
        self.go = threading.Event()
        self.closed_mid_write = False
        self._busy = False

    def save(self, *args: Any, **kwargs: Any) -> None:
        first = not self.writing.is_set()
        self.writing.set()
        self._busy = True
        try:
            if first:
                assert self.go.wait(30), "the test never let the write go"
            super().save(*args, **kwargs)
        finally:
            self._busy = False

    def close(self) -> None:
        self.closed_mid_write |= self._busy
        super().close()


async def test_a_stop_during_a_write_waits_for_it_and_the_record_is_on_disk(
    tmp_path: Path,
) -> None:
    state_dir = str(tmp_path / "state")
    store = _HeldStore(state_dir)
    svc = CoordinatorService(store=store)
    svc.start()
    ready = svc.cluster.node_connected("node-0", "127.0.0.1", 2, "inc-1", time.time())
    svc.apply(list(ready))
    assert await asyncio.to_thread(store.writing.wait, 10), "the node's record was never written"
    # The stop comes while the write is under way in its thread.
    stop = asyncio.create_task(svc.stop())
    done, _ = await asyncio.wait({stop}, timeout=0.5)
    stopped_under_the_write = stop in done
    store.go.set()
    await asyncio.wait_for(stop, 10)
    store.close()
    assert not stopped_under_the_write, "the stop ended while its last write was still running"
    assert not store.closed_mid_write
    assert [n["name"] for n in Store(state_dir).load().nodes] == ["node-0"]
