"""Job events to site sinks, off the coordinator's event loop, and the JSON-lines file sink.

What torchelastic's `--event-log-handler` does for its agent's events, for every job's events:
each `EventRecorded` effect the coordinator carries out goes, as the `JobEvent` it records, to
every sink (`coordinator serve --event-sink module:object`, `--event-log FILE`). A sink is an
object with `emit(event)` (and, optionally, `close()`) or a plain callable of one argument.

Each sink has its own bounded queue and thread: the loop only puts an event on each queue and
never waits; a sink that is slow, or hangs, loses the events that do not fit, counted in
`dropped` (and logged, at most once per `DROP_LOG_EVERY` drops). A sink that raises loses that
event only, counted in `failed`. Events carry what the coordinator shows anyone (reasons built
from redacted specs), never a spec's env or argv.

`JsonLinesFile` writes one JSON object per line to a file created 0600 (an existing one must be
a regular file we own; it is made 0600), rotated at `max_bytes` to `FILE.1` ... `FILE.<backups>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

from client.model import JobEvent
from client.plugins import MAX_PLUGINS, load_entry_points, load_plugin
from coordinator._cluster import Effect, EventRecorded

__all__ = ["EventSinks", "JsonLinesFile", "load_event_sink", "open_event_sinks"]

logger = logging.getLogger(__name__)

ENTRY_POINTS = "gelastic.event_sinks"
QUEUE_EVENTS = 10_000
"""Events a sink may fall behind by before the newest ones are dropped."""
DROP_LOG_EVERY = 1000
MAX_LINE_BYTES = 64 * 1024
"""An event's line is cut to this (its reason shortened) so one line never outgrows a file."""
STOP_WAIT_S = 2.0
"""How long a stopping coordinator lets each sink drain its queue."""
_END = object()


def event_json(event: JobEvent) -> dict[str, Any]:
    """The event as the JSON-lines sink writes it (every field of `JobEvent`)."""
    return dataclasses.asdict(event)


class JsonLinesFile:
    """`--event-log FILE`: one JSON object per event per line, 0600, rotated by size."""

    def __init__(self, path: str, *, max_bytes: int = 64 * 1024 * 1024, backups: int = 3) -> None:
        if not 4096 <= max_bytes <= 1 << 40:
            raise ValueError(f"event log max_bytes: must be 4096 B-1 TiB, got {max_bytes}")
        if not 0 <= backups <= 100:
            raise ValueError(f"event log backups: must be 0-100, got {backups}")
        self.path = os.path.abspath(path)
        self.max_bytes, self.backups = max_bytes, backups
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise ValueError(f"event log {self.path}: not a regular file of this user")
        os.fchmod(fd, 0o600)
        return fd

    def emit(self, event: JobEvent) -> None:
        line = json.dumps(event_json(event), separators=(",", ":")).encode() + b"\n"
        if len(line) > MAX_LINE_BYTES:
            cut = dataclasses.replace(event, reason=event.reason[: MAX_LINE_BYTES // 8] + "...")
            line = json.dumps(event_json(cut), separators=(",", ":")).encode()[:MAX_LINE_BYTES]
            line += b"\n"
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        os.write(self._fd, line)
        self._size += len(line)

    def _rotate(self) -> None:
        os.close(self._fd)
        if self.backups == 0:
            os.unlink(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._fd, self._size = self._open(), 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def load_event_sink(ref: str) -> tuple[str, Any]:
    """(name, sink) of an `--event-sink` value: `jsonl:/path` (the file sink) or `module:object`."""
    if ref.startswith("jsonl:"):
        path = ref[len("jsonl:") :]
        if not path or len(path) > 4096:
            raise ValueError(f"event sink {ref[:200]!r}: expected jsonl:/path/to/file")
        return ref, JsonLinesFile(path)
    sink = load_plugin(ref)
    if not callable(getattr(sink, "emit", None)) and not callable(sink):
        raise ValueError(f"event sink {ref}: neither callable nor with an emit(event) method")
    return ref, sink


class _Lane:
    """One sink, its queue and its thread."""

    def __init__(self, name: str, sink: Any, size: int) -> None:
        self.name, self.sink = name, sink
        emit = getattr(sink, "emit", None)
        self.emit: Callable[[JobEvent], object] = emit if callable(emit) else sink
        self.queue: queue.Queue[object] = queue.Queue(size)
        self.dropped = self.failed = 0
        self.thread = threading.Thread(target=self._run, name=f"event-sink {name}", daemon=True)

    def put(self, event: JobEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            if self.dropped % DROP_LOG_EVERY == 1:
                logger.warning(
                    "event sink %s is behind: %d events dropped", self.name, self.dropped
                )

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _END:
                break
            try:
                self.emit(item)  # type: ignore[arg-type]
            except Exception:
                self.failed += 1
                if self.failed % DROP_LOG_EVERY == 1:
                    logger.exception("event sink %s failed (%d so far)", self.name, self.failed)
        close = getattr(self.sink, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                logger.exception("event sink %s: close failed", self.name)


class EventSinks:
    """Every configured sink; `observe` is a coordinator effect observer (never blocks)."""

    def __init__(self, sinks: Sequence[tuple[str, Any]], *, queue_events: int = QUEUE_EVENTS):
        self._lanes = [_Lane(name, sink, queue_events) for name, sink in sinks]
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            for lane in self._lanes:
                lane.thread.start()

    def observe(self, effects: Sequence[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, EventRecorded):
                for lane in self._lanes:
                    lane.put(eff.event)

    def dropped(self) -> dict[str, int]:
        """Events each sink lost: to a full queue, or to its own exception."""
        return {lane.name: lane.dropped + lane.failed for lane in self._lanes}

    def stop(self, wait: float = STOP_WAIT_S) -> None:
        """Let each sink drain for at most `wait` s, then close it (in its thread); idempotent.
        A sink that hangs is left behind in its daemon thread."""
        if not self._started:
            return
        self._started = False
        for lane in self._lanes:
            with contextlib.suppress(queue.Full):
                lane.queue.put(_END, timeout=wait)
        for lane in self._lanes:
            lane.thread.join(wait)
            if lane.thread.is_alive():
                logger.warning("event sink %s did not finish within %g s", lane.name, wait)


def open_event_sinks(refs: Sequence[str], event_log: str) -> EventSinks | None:
    """The sinks `coordinator serve` was given (`--event-sink`, `--event-log`) and those of the
    `gelastic.event_sinks` entry points; None when there are none. ValueError naming a bad one."""
    sinks = [load_event_sink(ref) for ref in refs]
    if event_log:
        sinks.append((f"jsonl:{event_log}", JsonLinesFile(event_log)))
    sinks += load_entry_points(ENTRY_POINTS, limit=MAX_PLUGINS - len(sinks))
    return EventSinks(sinks) if sinks else None
