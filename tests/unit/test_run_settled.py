"""gelastic run prints a failed job's report once the failed round's last exits are in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from client.model import ProcessFailure, RunResult, WorkerState
from gelastic._cli_run import settled


def _failure(rank: int, ts: float) -> ProcessFailure:
    return ProcessFailure(
        global_rank=rank, local_rank=rank, pid=1, exitcode=1, message="x", timestamp=ts
    )


@dataclass
class _Status:
    workers: list[Any]


@dataclass
class _Worker:
    state: WorkerState


@dataclass
class FakeJob:
    """Rank 2's gloo error was known first; rank 1's earlier death arrives on the 3rd look."""

    looks: int = 0
    final: RunResult = field(
        default_factory=lambda: RunResult(
            state=WorkerState.FAILED,
            failures={1: _failure(1, 1.0), 2: _failure(2, 1.03)},
        )
    )

    def status(self) -> _Status:
        self.looks += 1
        state = WorkerState.FAILED if self.looks >= 3 else WorkerState.HEALTHY
        return _Status([_Worker(WorkerState.FAILED), _Worker(state)])

    def poll(self) -> RunResult:
        return self.final


def test_the_report_waits_for_the_round_to_end_and_names_the_earlier_root_cause() -> None:
    early = RunResult(state=WorkerState.FAILED, failures={2: _failure(2, 1.03)})
    job = FakeJob()
    result = settled(job, early, stop_grace=5.0)  # type: ignore[arg-type]
    assert job.looks == 3
    assert result.root_cause is not None and result.root_cause.global_rank == 1


def test_a_round_that_never_ends_holds_the_report_only_for_the_bound() -> None:
    class Stuck(FakeJob):
        def status(self) -> _Status:
            return _Status([_Worker(WorkerState.HEALTHY)])

    started = time.monotonic()
    early = RunResult(state=WorkerState.FAILED, failures={2: _failure(2, 1.03)})
    settled(Stuck(), early, stop_grace=-1.7)  # type: ignore[arg-type]  # a 0.3 s bound
    assert time.monotonic() - started < 3.0


def test_a_result_that_did_not_fail_is_returned_as_it_is() -> None:
    ok = RunResult(state=WorkerState.SUCCEEDED)
    job = FakeJob()
    assert settled(job, ok, stop_grace=30) is ok and job.looks == 0  # type: ignore[arg-type]
