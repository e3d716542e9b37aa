"""The service stops however its flush loop is caught: even when the wake-up of its batching
pause lands in the same moment as the cancel.

(`asyncio.wait_for` on Python 3.11 returns the inner result instead of raising when the inner
wait finishes in the very step the outer task is cancelled: a loop built on it then never ends.)
"""

from __future__ import annotations

import asyncio

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
