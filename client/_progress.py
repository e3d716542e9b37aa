"""The progress a waiting client prints: one line per change of a job's state, or one updating
line on a terminal; each event worth telling once, in order, never a snapshot older than one
already shown.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import BinaryIO, TextIO

from client._terminal import strip_terminal_controls
from client.model import (
    JobEvent,
    JobState,
    JobStatus,
)
from client.wire import (
    event_from_pb,
    job_status_from_pb,
)
from protos.gelastic.v1 import gelastic_pb2 as pb

_SHOWN_EVENTS = frozenset({"worker_failed", "node_lost", "restart", "round_formed"})
"""Events the progress printer shows as lines of their own ("finished" is the last state line)."""
_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")


class _Progress:
    """Live progress: one updating line on a terminal; elsewhere a line per change of state.

    Every line starts with the job's id. Worker output streamed beside it (`write_above`) goes
    above the updating line, under the same lock, so the two never tear each other's lines.
    """

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = ""
        self._last_key: tuple[object, ...] | None = None
        self._open = False  # an updating line is on the terminal now
        self.seen_seq = 0
        self._reattaching = False
        # The (attempt, round) of what was printed last: a snapshot of an earlier one is older
        # than the lines above it and is not printed (a watch opened again, a status read
        # before the events it is shown with).
        self._shown_at = (0, 0)
        # The round whose round_formed event is the last line printed: its own rendezvous
        # snapshot (the master port being reserved) says nothing new.
        self._formed: tuple[int, int] | None = None
        self.state: JobState | None = None
        """The job's state in the latest snapshot shown (None before the first)."""
        self.lock = threading.Lock()

    def show(self, update: pb.JobUpdate) -> None:
        self.show_status(job_status_from_pb(update.job), [event_from_pb(e) for e in update.events])

    def show_status(self, status: JobStatus, events: Sequence[JobEvent] = ()) -> None:
        with self.lock:
            for e in events:
                if e.seq and e.seq <= self.seen_seq:
                    continue  # a watch opened again replays the timeline from its start
                self.seen_seq = max(self.seen_seq, e.seq)
                if e.kind == "recovered":
                    if self._reattaching:
                        self._line(f"[{status.job_id}] coordinator restarted; re-attaching", True)
                elif e.kind in _SHOWN_EVENTS:
                    self._line(f"[{status.job_id}] {e.reason}", keep=True)
                    self._shown_at = max(self._shown_at, (e.attempt, e.round))
                    self._formed = (e.attempt, e.round) if e.kind == "round_formed" else None
            self._reattaching = False
            at = (status.attempt, status.round)
            if at < self._shown_at and not status.state.is_terminal():
                return
            self._shown_at = at
            self.state = status.state
            if (
                at == self._formed
                and status.state in (JobState.QUEUED, JobState.RENDEZVOUS)
                and not self.tty
            ):
                return
            self._formed = None
            line = progress_line(status)
            if self.tty:
                if line != self.last or not self._open:
                    self._line(line, keep=False)
            else:
                # Countdowns ("closes in 3 s") change each second; a state change is the rest.
                key = _progress_key(status)
                if key != self._last_key:
                    self._line(line, keep=True)
                    self._last_key = key
            self.last = line

    def reattaching(self) -> None:
        """The watch broke (the coordinator went away): the next update says what happened."""
        with self.lock:
            self._reattaching = True

    def _line(self, text: str, keep: bool) -> None:
        if self.tty:
            # Reasons quote workers (failure messages): none of their escape sequences runs.
            text = strip_terminal_controls(text)
            self.out.write("\r\x1b[2K" + text + ("\n" if keep else ""))
            self._open = not keep
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def write_above(self, stream: BinaryIO, data: bytes) -> None:
        """Write `data` (whole lines) to `stream`, above the updating progress line."""
        with self.lock:
            if self._open:
                self.out.write("\r\x1b[2K")
                self.out.flush()
            stream.write(data)
            stream.flush()
            if self._open:
                self.out.write(strip_terminal_controls(self.last))
                self.out.flush()

    def done(self) -> None:
        with self.lock:
            if self.tty and self._open:
                self.out.write("\n")
                self.out.flush()
            self._open = False


def _progress_key(status: JobStatus) -> tuple[object, ...]:
    from client.model import WorkerState

    counts = tuple(
        sum(1 for w in status.workers if w.state == s)
        for s in (WorkerState.HEALTHY, WorkerState.SUCCEEDED, WorkerState.INIT)
    )
    reason = "" if status.state.value == "RUNNING" and status.workers else status.reason
    return (status.state, status.attempt, status.round, counts, _SECONDS.sub("", reason))


def progress_line(status: JobStatus) -> str:
    """One human line for a job's current state."""
    from client.model import JobState, WorkerState

    if status.state == JobState.RUNNING and status.workers:
        n = len(status.workers)
        healthy = sum(1 for w in status.workers if w.state == WorkerState.HEALTHY)
        done = sum(1 for w in status.workers if w.state == WorkerState.SUCCEEDED)
        starting = sum(1 for w in status.workers if w.state == WorkerState.INIT)
        parts = [f"{healthy}/{n} workers healthy"]
        if done:
            parts.append(f"{done} done")
        if starting:
            parts.append(f"{starting} starting")
        return f"[{status.job_id}] attempt {status.attempt} running: {', '.join(parts)}"
    state = status.state.value.lower()
    reason = status.reason
    # The coordinator's reasons often name the state already ("rendezvous: 2/3 nodes").
    if reason.lower().startswith(state + ":"):
        reason = reason[len(state) + 1 :].lstrip()
    return f"[{status.job_id}] {state}: {reason}" if reason else f"[{status.job_id}] {state}"
