"""The dashboard's server-sent events: what wakes a stream, how one event is written, and the
keepalives that notice a browser that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from coordinator._cluster import Effect


class ChangeFeed:
    """Wakes the cluster-wide streams on every batch of effects the service applies."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def observe(self, effects: list[Effect]) -> None:
        # Every apply, even one without effects: a heartbeat moves a node's last-seen time.
        self.version += 1
        self._event.set()

    async def wait(self, seen: int, timeout: float) -> int:
        if self.version == seen:
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        return self.version


def sse_event(event: str, data: Any) -> bytes:
    # json.dumps never writes a newline without indent: the data is one `data:` line.
    return f"event: {event}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode()


async def with_keepalive(
    source: AsyncIterator[bytes], interval: float
) -> AsyncIterator[bytes | None]:
    """The items of `source`, and None whenever `interval` s pass without one."""
    it = aiter(source)
    next_item: asyncio.Task[bytes] | None = None
    try:
        while True:
            if next_item is None:
                next_item = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait((next_item,), timeout=interval)
            if not done:
                yield None
                continue
            task, next_item = next_item, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if next_item is not None:
            next_item.cancel()
            with contextlib.suppress(BaseException):
                await next_item
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
