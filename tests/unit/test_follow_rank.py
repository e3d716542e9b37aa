"""`gelastic logs -f` (client._logrelay.follow_rank) against a scripted job: which attempts'
logs it reads, in which order, and what it says between them. No network, no sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from client._client import GelasticError
from client._logrelay import follow_rank
from client.model import JobState, JobStatus, WorkerState, WorkerStatus


def _status(state: JobState, attempt: int, round_: int, *, running: bool) -> JobStatus:
    workers = (
        (WorkerStatus(global_rank=0, local_rank=0, node="a", state=WorkerState.HEALTHY, pid=7),)
        if running
        else ()
    )
    return JobStatus(
        job_id="j",
        name="",
        state=state,
        reason="",
        attempt=attempt,
        round=round_,
        max_restarts=3,
        min_nodes=1,
        max_nodes=1,
        workers=workers,
    )


class _ScriptedJob:
    """Answers status() from a script, one snapshot per call; logs() from the logs per attempt
    (the latest for None); a missing attempt is NOT_FOUND."""

    def __init__(self, statuses: list[JobStatus], logs: dict[int, bytes]) -> None:
        self.statuses = statuses
        self.logs_by_attempt = logs
        self.reads: list[tuple[int | None, bool]] = []

    def status(self) -> JobStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def logs(self, rank: int, stream: str, attempt: int | None, follow: bool) -> Iterator[bytes]:
        self.reads.append((attempt, follow))
        key = max(self.logs_by_attempt, default=-1) if attempt is None else attempt
        if key not in self.logs_by_attempt:
            raise GelasticError(grpc.StatusCode.NOT_FOUND, f"no logs for rank {rank}")
        yield self.logs_by_attempt[key]


def _follow(job: _ScriptedJob) -> tuple[bytes, list[str]]:
    notes: list[str] = []
    out = b"".join(follow_rank(job, 0, "stdout", notes.append, poll_s=0))  # type: ignore[arg-type]
    return out, notes


def test_an_attempt_that_came_and_went_between_two_looks_is_read_whole() -> None:
    job = _ScriptedJob(
        [
            _status(JobState.RENDEZVOUS, 0, 0, running=False),
            _status(JobState.RUNNING, 0, 1, running=True),
            # Attempt 1 started, failed and was replaced before the next look.
            _status(JobState.RUNNING, 2, 3, running=True),
            _status(JobState.SUCCEEDED, 2, 3, running=False),
        ],
        {0: b"attempt 0\n", 1: b"attempt 1\n", 2: b"attempt 2\n"},
    )
    out, notes = _follow(job)
    assert out == b"attempt 0\nattempt 1\nattempt 2\n"
    assert notes == [
        "rank 0 ran in attempt 1 meanwhile; its log follows",
        "rank 0 runs again in attempt 2 (round 3); following it",
    ]
    assert job.reads == [(0, True), (1, False), (2, True)]


def test_a_job_that_ended_before_the_rank_started_is_not_found() -> None:
    job = _ScriptedJob(
        [
            _status(JobState.QUEUED, 0, 0, running=False),
            _status(JobState.FAILED, 0, 0, running=False),
        ],
        {},
    )
    with pytest.raises(GelasticError) as err:
        _follow(job)
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_a_rank_whose_file_is_not_there_yet_is_asked_again() -> None:
    job = _ScriptedJob(
        [
            _status(JobState.RUNNING, 0, 1, running=True),
            _status(JobState.SUCCEEDED, 0, 1, running=False),
        ],
        {0: b"done\n"},
    )
    calls: dict[str, Any] = {"n": 0}
    real = job.logs

    def first_missing(rank: int, stream: str, attempt: int | None, follow: bool) -> Iterator[bytes]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise GelasticError(grpc.StatusCode.NOT_FOUND, "node a has no stdout log yet")
        return real(rank, stream, attempt, follow)

    job.logs = first_missing  # type: ignore[method-assign]
    out, notes = _follow(job)
    assert out == b"done\n" and notes == []
    assert calls["n"] == 2
