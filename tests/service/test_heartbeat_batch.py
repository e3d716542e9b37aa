"""Heartbeats are taken in batches: a beat read from a stream waits a moment for the others,
but it still lands, and never after a message its node sent later."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from client import Client, JobSpec
from client.model import WorkerState
from coordinator import _heartbeat_batch
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._helpers import wait_for

from ._fakes import FakeNode, run_round, worker_exit


def _beat(asg: pb.Assign, state: int) -> pb.Heartbeat:
    return pb.Heartbeat(
        seq=1, groups=[pb.GroupHealth(job_id=asg.job_id, round=asg.round, state=state)]
    )


def _config(tmp_path: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        state_dir=str(tmp_path / "state"), port=0, heartbeat_interval=0.5, lease=10.0
    )


@contextlib.asynccontextmanager
async def _two_node_round(
    tmp_path: Path,
) -> AsyncIterator[tuple[Coordinator, FakeNode, FakeNode, str, pb.Assign, pb.Assign]]:
    """A coordinator, nodes a and b, and the round of a 2-node job on them."""
    async with Coordinator(_config(tmp_path)) as c:
        a = FakeNode(c.address, "a", "10.0.0.1", slots=1)
        b = FakeNode(c.address, "b", "10.0.0.2", slots=1)
        await a.connect()
        await b.connect()
        client = Client(c.address, timeout=10)
        try:
            job = await asyncio.to_thread(
                client.submit,
                JobSpec(entrypoint=["true"], min_nodes=2, max_nodes=2, last_call_timeout=0),
            )
            aa, ab = await run_round(a, b)
            yield c, a, b, job.job_id, aa, ab
        finally:
            client.close()
            await a.close()
            await b.close()


async def test_a_heartbeat_lands_and_never_after_what_its_node_sent_next(tmp_path: Path) -> None:
    async with _two_node_round(tmp_path) as (c, a, b, job_id, aa, ab):
        cluster = c.service.cluster

        def group(node: str) -> WorkerState | None:
            members = cluster.job_status(job_id).members
            return next((m.group_state for m in members if m.node == node), None)

        # A beat alone lands, within a batch.
        await b.send(heartbeat=_beat(ab, pb.GROUP_STATE_UNHEALTHY))
        await wait_for(lambda: group("b") == WorkerState.UNHEALTHY, 5.0, what="b's beat")
        # A beat followed at once by the exit of the node's worker: the exit comes second.
        await a.send(heartbeat=_beat(aa, pb.GROUP_STATE_UNHEALTHY))
        await a.send(**{"worker_exited": worker_exit(aa, 0, 0).worker_exited})
        await wait_for(lambda: group("a") == WorkerState.SUCCEEDED, 5.0, what="a's exit")
        await asyncio.sleep(0)  # nothing is left to land after it
        c.service.take_heartbeats()
        assert group("a") == WorkerState.SUCCEEDED


async def test_a_beat_that_repeats_the_last_is_not_decoded_again_but_still_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real = _heartbeat_batch.decode_node

    def counting(msg: pb.NodeMessage) -> Any:
        decoded.append(msg.heartbeat.seq)
        return real(msg)

    monkeypatch.setattr(_heartbeat_batch, "decode_node", counting)
    async with _two_node_round(tmp_path) as (c, a, _, job_id, aa, _):
        cluster = c.service.cluster

        def group() -> WorkerState | None:
            members = cluster.job_status(job_id).members
            return next(m.group_state for m in members if m.node == "a")

        def seen() -> float:
            return next(n.last_seen for n in cluster.nodes() if n.name == "a")

        await wait_for(lambda: cluster.round_progress(job_id)[2], 5.0, what="the workers started")
        for seq in (1, 2, 3):  # the same beat, seq apart: decoded once, each one taken
            before = seen()
            beat = _beat(aa, pb.GROUP_STATE_UNHEALTHY)
            beat.seq = seq
            await a.send(heartbeat=beat)
            await wait_for(lambda b=before: seen() > b, 5.0, what=f"beat {seq} taken")
        assert decoded == [1] and group() == WorkerState.UNHEALTHY
        # A beat that says something new is decoded, and lands.
        changed = _beat(aa, pb.GROUP_STATE_HEALTHY)
        changed.seq = 9
        await a.send(heartbeat=changed)
        await wait_for(lambda: group() == WorkerState.HEALTHY, 5.0, what="the new beat")
        assert decoded == [1, 9]


async def test_while_changes_wait_for_the_write_a_heartbeat_brings_no_fast_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Coordinator(_config(tmp_path)) as c:
        a = FakeNode(c.address, "a", "10.0.0.1", slots=1)
        await a.connect()
        await a.expect("clock_probe")  # the first, as the session opens
        cluster = c.service.cluster

        def seen() -> float:
            return next(n.last_seen for n in cluster.nodes() if n.name == "a")

        try:
            busy = True
            monkeypatch.setattr(c.service.journal, "wants_flush", lambda: busy)
            before = seen()
            await a.send(heartbeat=pb.Heartbeat(seq=1))
            await wait_for(lambda: seen() > before, 5.0, what="the busy beat taken")
            busy = False
            idle_from = c.service.now()
            await a.send(heartbeat=pb.Heartbeat(seq=2))
            probe = await a.expect("clock_probe")
            assert probe.clock_probe.sent_at >= idle_from  # none came with the busy beat
        finally:
            await a.close()
