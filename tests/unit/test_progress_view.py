"""How a job's progress reads in `gelastic status` and in a frame of `gelastic top` (pure)."""

from __future__ import annotations

from client._cli_top import top_text
from client._tables import status_text
from client.model import JobState, JobStatus, WorkerState, WorkerStatus


def status(stall: str = "") -> JobStatus:
    workers = tuple(
        WorkerStatus(
            global_rank=r,
            local_rank=r % 2,
            node=f"n{r // 2}",
            state=WorkerState.HEALTHY,
            cpu_percent=97.0,
            rss_bytes=300 * 2**20,
            step=None if r == 3 else 40 + r,
            steps_per_s=0.0 if r == 3 else 12.5,
            last_step_age=None if r == 3 else 0.4,
            metrics={} if r == 3 else {"loss": 0.25, "lr\nx": 1.0},
            behind=r == 2 and bool(stall),
            straggler=r == 1,
        )
        for r in range(4)
    )
    return JobStatus(
        job_id="job-1",
        name="train",
        state=JobState.RUNNING,
        reason="attempt 0 running: 4 workers",
        attempt=0,
        round=1,
        max_restarts=0,
        min_nodes=2,
        max_nodes=2,
        workers=workers,
        world_size=4,
        stall_reason=stall,
    )


RANKS = {"0", "1", "2", "3"}


def rows(text: str) -> dict[str, list[str]]:
    return {r[0]: r for r in (line.split() for line in text.splitlines()) if r and r[0] in RANKS}


def test_status_shows_each_ranks_step_rate_flags_and_metrics() -> None:
    text = status_text(status())
    assert "progress:" in text and "STALLED" not in text
    progress = text[text.index("progress:") :]
    found = rows(progress)
    assert found["0"][3:6] == ["40", "12.50", "0.4"]
    assert "STRAGGLER" in found["1"] and "loss=0.25" in found["1"]
    assert found["3"][3:6] == ["-", "-", "-"]  # never reported a step


def test_a_stalled_job_says_why_and_marks_the_ranks_behind() -> None:
    text = top_text(status(stall="stalled: rank 2 (n1) made no step for 3 s"))
    assert "STALLED: stalled: rank 2 (n1) made no step for 3 s" in text
    assert "BEHIND" in rows(text)["2"] and "BEHIND" not in rows(text)["0"]
    assert text.splitlines()[0].startswith("job job-1 (train)  RUNNING")
