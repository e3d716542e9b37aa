"""The coordinator's write-ahead journal: what changed and is not on disk yet, and what waits
for it to be.

Nothing an agent is told and nothing a client reads runs ahead of the disk: messages to agents
wait here (in order) while a change they follow is not yet written, and readers of a job wait
while that job has unwritten changes. `Journal.flush` writes every change noted so far in one
batch, then lets the held messages go and wakes the readers; `Journal.flush_loop` makes one
such batch of each burst of changes; `Journal.restore` reads back what an earlier process
wrote. The state machine's `Ready` (coordinator._cluster) splits its effects into the
changes the journal records and what the service then sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc

from coordinator._cluster import (
    Change,
    CloseSession,
    Cluster,
    Effect,
    EventRecorded,
    EventsCut,
    Forgotten,
    JobChanged,
    NodeChanged,
)
from coordinator._codec import encode
from coordinator._errors import RequestError
from coordinator._node_sessions import _Session
from coordinator._store import JobRecord, StateStore, StoreFenced, StoreUnavailable
from protos.gelastic.v1 import gelastic_pb2 as pb

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.05
EVENT_SEQ_KEY = "event_seq_reserved"
EVENT_SEQ_BLOCK = 10_000
WRITE_WAIT_S = 30.0
"""How long a reader waits for the state it would see to be on disk."""


class Journal:
    """The changes to the cluster state that the store has not written yet, the messages to
    agents that wait for them, and the readers that wait for them."""

    def __init__(
        self, store: StateStore | None, cluster: Cluster, fenced: Callable[[str], None]
    ) -> None:
        self._store = store
        """Where the changes go; None: nowhere, and nothing waits for a write."""
        self._cluster = cluster
        self._fenced = fenced
        """Called when the store refused a write because another coordinator leads."""
        self._dirty_jobs: set[str] = set()
        self._pending_events: list[tuple[int, str, dict[str, Any]]] = []
        self._dirty_nodes: set[str] = set()
        self._forget_jobs: set[str] = set()
        self._forget_nodes: set[str] = set()
        self._cut_events: list[tuple[str, int, int]] = []
        self._flush_lock = asyncio.Lock()
        self.flush_wanted = asyncio.Event()
        """Set when there is something to write: the flush loop waits on it."""
        self._held: list[tuple[_Session, pb.CoordinatorMessage]] = []
        self._unwritten_jobs: set[str] = set()
        self._written = asyncio.Condition()
        self._readers_waiting = 0
        self.urgent = asyncio.Event()
        """Set when a message or a reader waits on the write: the batching pause ends early."""
        self._message_held = asyncio.Event()
        """Set when a message waits on the write: the pause after a costly write ends too."""
        self._seq_reserved = 0
        self._seq_reservation_dirty = False
        self._unsaved_members: dict[str, frozenset[int]] = {}
        """Members of each job whose record the store failed to write: named again next time."""

    # ---- what changed ----------------------------------------------------------------------

    def restore(self, clock: Callable[[], float], reconnect_grace: float) -> list[Effect]:
        """Load what an earlier coordinator process wrote into the cluster; return the effects
        of the restart (see Cluster.restore).

        Event numbering resumes past the reservation on disk, and the records the cluster could
        not read are set aside in the store (quarantined), not lost.
        """
        store = self._store
        assert store is not None
        state = store.load()
        self._seq_reserved = _int(state.meta.get(EVENT_SEQ_KEY, "0"))
        effects = self._cluster.restore(
            state.jobs,
            state.events,
            state.nodes,
            clock(),
            reconnect_grace,
            event_seq_floor=self._seq_reserved,
        )
        if self._cluster.bad_records:
            keys: dict[str, Sequence[object]] = {
                "jobs": state.job_keys,
                "events": state.event_keys,
                "nodes": state.node_keys,
            }
            store.quarantine(
                (kind, keys[kind][i], why) for kind, i, why in self._cluster.bad_records
            )
        self.reserve_event_numbers()
        return effects

    def record(self, persist: Sequence[Change]) -> None:
        """Note what a batch's `Ready.persist` changes on disk: jobs, events, cuts of events,
        forgettings, nodes."""
        for eff in persist:
            if isinstance(eff, JobChanged):
                if eff.durable:
                    self._dirty_jobs.add(eff.job_id)
                    self._unwritten_jobs.add(eff.job_id)
            elif isinstance(eff, EventRecorded):
                e = eff.event
                self._pending_events.append((e.seq, e.job_id, encode(e)))
                self._unwritten_jobs.add(e.job_id)
            elif isinstance(eff, EventsCut):
                self._cut_events.append((eff.job_id, eff.after_seq, eff.before_seq))
                self._unwritten_jobs.add(eff.job_id)
            elif isinstance(eff, Forgotten):
                if eff.job_id:
                    self.discard(eff.job_id)
                if eff.node:
                    self._forget_nodes.add(eff.node)
                    self._dirty_nodes.discard(eff.node)
        # The nodes' records after the forgettings: a node changed and forgotten in one batch
        # stays dirty (the write then finds no record of it to save, and deletes it).
        for eff in persist:
            if isinstance(eff, NodeChanged | CloseSession):
                self._dirty_nodes.add(eff.node)
        self.reserve_event_numbers()

    def node_changed(self, name: str) -> None:
        """Note that node `name`'s record changed."""
        self._dirty_nodes.add(name)

    def discard(self, job_id: str) -> None:
        """Forget job `job_id`: nothing of it that is not written yet will be, and the next
        write deletes what is."""
        self._forget_jobs.add(job_id)
        self._unsaved_members.pop(job_id, None)
        self._dirty_jobs.discard(job_id)
        self._pending_events = [e for e in self._pending_events if e[1] != job_id]
        self._unwritten_jobs.discard(job_id)

    def is_unwritten(self, job_id: str) -> bool:
        """Whether job `job_id` has a change that is not on disk yet."""
        return job_id in self._unwritten_jobs

    def reserve_event_numbers(self) -> None:
        # Event numbers are reserved on disk a block ahead, written with the events that use
        # them: after a crash numbering resumes past the block, so no number is given twice.
        if (
            self._store is not None
            and self._cluster.event_seq + EVENT_SEQ_BLOCK // 2 > self._seq_reserved
        ):
            self._seq_reserved = self._cluster.event_seq + EVENT_SEQ_BLOCK
            self._seq_reservation_dirty = True

    def wants_flush(self) -> bool:
        """Whether there is a change to write."""
        return self._store is not None and bool(
            self._dirty_jobs
            or self._pending_events
            or self._dirty_nodes
            or self._forget_jobs
            or self._forget_nodes
            or self._cut_events
        )

    def _job_record(self, job_id: str) -> JobRecord:
        """The job's record to write, naming the members changed since the last write that
        succeeded (a record only names those changed since the record before it)."""
        record = self._cluster.job_record(job_id)
        missed = self._unsaved_members.pop(job_id, None)
        if missed:
            n = len(record.members)
            record = dataclasses.replace(
                record, changed=record.changed | {i for i in missed if i < n}
            )
        return record

    # ---- what waits for the write ----------------------------------------------------------

    def send_after_write(self, session: _Session, msg: pb.CoordinatorMessage) -> None:
        """Send `msg` on `session` now, or after the write of the changes it follows."""
        if self._store is not None and (
            self._held or self._dirty_jobs or self._pending_events or self._dirty_nodes
        ):
            self._held.append((session, msg))  # after the write that makes it safe (see flush)
            self.urgent.set()
            self._message_held.set()
            return
        session.send(msg)

    def drop_held(self) -> None:
        """Drop the messages that wait for a write: they will never be sent."""
        self._held = []

    # ---- the write -------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write every change made so far; returns once it is on disk.

        The messages to agents decided up to now go out only after the write, and readers
        waiting for these jobs are woken.
        """
        store = self._store
        if store is None:
            return
        async with self._flush_lock:
            c = self._cluster
            batch = sorted(self._dirty_jobs)
            jobs = [
                (j, c.job_submitted_at(j), c.job_state(j).value, self._job_record(j))
                for j in batch
                if c.has_job(j)
            ]
            events, nodes = self._pending_events, None
            if self._dirty_nodes:
                nodes = [
                    (n, d) for n in sorted(self._dirty_nodes) if (d := c.dump_node(n)) is not None
                ]
            held, self._held = self._held, []
            self._dirty_jobs, self._pending_events, self._dirty_nodes = set(), [], set()
            forget_jobs, forget_nodes = self._forget_jobs, self._forget_nodes
            self._forget_jobs, self._forget_nodes = set(), set()
            cuts, self._cut_events = self._cut_events, []
            meta = None
            if self._seq_reservation_dirty:
                meta = {EVENT_SEQ_KEY: str(self._seq_reserved)}
                self._seq_reservation_dirty = False
            cancelled = False
            if jobs or events or nodes is not None or meta or forget_jobs or forget_nodes or cuts:
                save = asyncio.ensure_future(
                    asyncio.to_thread(
                        store.save, jobs, events, nodes, meta, forget_jobs, forget_nodes, cuts
                    )
                )
                # The write runs on in its thread whatever happens to this task: a cancel (a
                # stop) waits for its end, then takes effect. Else the stop would find nothing
                # left to write (it is all marked clean), close the store under the write, and
                # drop the messages that wait for it.
                cancelled = await _to_its_end(save)
                try:
                    save.result()
                except Exception as exc:
                    if isinstance(exc, StoreFenced):
                        logger.error("the coordinator state was not written: %s", exc)
                        self._fenced(str(exc))
                    elif isinstance(exc, StoreUnavailable):  # no traceback each second it is down
                        logger.error("could not write the coordinator state; will retry: %s", exc)
                    else:
                        logger.exception("could not write the coordinator state; will retry")
                    self._dirty_jobs.update(j for j, _, _, _ in jobs)
                    for j, _, _, record in jobs:  # their members are still to be written
                        self._unsaved_members[j] = record.changed
                    self._pending_events = events + self._pending_events
                    self._dirty_nodes.update(n for n, _ in nodes or ())
                    self._held = held + self._held
                    self._seq_reservation_dirty |= meta is not None
                    self._forget_jobs |= forget_jobs
                    self._forget_nodes |= forget_nodes
                    self._cut_events = cuts + self._cut_events
                    if cancelled:
                        raise asyncio.CancelledError from exc
                    raise
            written = set(batch) | {j for _, j, _ in events}
            still = self._dirty_jobs | {j for _, j, _ in self._pending_events}
            self._unwritten_jobs = (self._unwritten_jobs - written) | still
            for session, msg in held:
                session.send(msg)
        async with self._written:
            self._written.notify_all()
        if cancelled:
            raise asyncio.CancelledError

    async def written(self, job_ids: Collection[str] | None = None) -> None:
        """Return once the named jobs (every job: None) have no change that is not on disk.

        A client must never see a state, a result or an event that a crash could take back.
        """
        if self._store is None:
            return

        def settled() -> bool:
            if job_ids is None:
                return not self._unwritten_jobs
            return self._unwritten_jobs.isdisjoint(job_ids)

        if settled():
            return
        self._readers_waiting += 1
        self.urgent.set()
        try:
            async with asyncio.timeout(WRITE_WAIT_S), self._written:
                while not settled():
                    self.flush_wanted.set()
                    await self._written.wait()
        except TimeoutError:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"the coordinator could not write its state for {WRITE_WAIT_S:.0f} s; try again",
            ) from None
        finally:
            self._readers_waiting -= 1

    async def flush_loop(self) -> None:
        """Write each burst of changes as one batch, for as long as the service runs."""
        # Batching: one transaction per burst of changes, however many node messages made them.
        while True:
            await self.flush_wanted.wait()
            self.flush_wanted.clear()
            started, cpu_started = time.monotonic(), time.process_time()
            try:
                await self.flush()
            except Exception:
                await asyncio.sleep(1.0)
                self.flush_wanted.set()
                continue  # a failed write is no batch to pause after: try again
            # A flush of a huge job costs O(ranks): pause in proportion so that a burst of
            # worker messages never spends more than a fifth of the loop on writing state. While
            # readers wait on the write, the pause is only that proportion; a message to a node
            # that waits on it ends the pause (a round's Assign after the write that formed the
            # round: such messages come once per step of a round, not once per report). Time
            # spent waiting on the store (an etcd that just got its quorum back) is no cost:
            # counted, it would hold back the messages that waited for that very write.
            cost = 4 * min(time.monotonic() - started, time.process_time() - cpu_started)
            self._message_held.clear()
            if not self._held:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cost):
                        await self._message_held.wait()
            # The rest of the batching pause ends early once a message or a reader waits on the
            # write: they are what a user waits for (a round's Assign, a job's end).
            self.urgent.clear()
            if not (self._held or self._readers_waiting):
                # asyncio.timeout, not wait_for: on 3.11, wait_for swallows a cancel that lands
                # in the step where the wait ends, and stop() would then wait on this forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, FLUSH_INTERVAL_S - cost)):
                        await self.urgent.wait()


async def _to_its_end(fut: asyncio.Future[None]) -> bool:
    """Wait until `fut` is done, even through cancels of the waiting task; whether one came.

    `fut` keeps its own outcome; `asyncio.wait` never cancels what it waits on.
    """
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        logger.error(
            "ignoring a stored event-number reservation that is not a number: %r", text[:40]
        )
        return 0
