"""Secrets inside a command line given as one string, and in `-pSECRET`, are withheld too.

Before the fix `redact_argv` looked at whole argv items only: `sh -c "train --password=x"` and
`mysql -psecret` were shown as they were by GetJob, ListJobs, WatchJob and the dashboard.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator

import pytest

from client import Client, JobSpec
from client.redaction import REDACTED, redact_argv
from coordinator.server import Coordinator, CoordinatorConfig

R = REDACTED


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (
            ["sh", "-c", "python train.py --password=hunter2 --lr 0.1"],
            ["sh", "-c", f"python train.py --password={R} --lr 0.1"],
        ),
        (
            ["bash", "-lc", "train --token  tok-123 --api-key='k e y' --epochs=3"],
            ["bash", "-lc", f"train --token  {R} --api-key={R} --epochs=3"],
        ),
        (
            ["sh", "-c", "bash -c 'x --secret=\"s 1\" y' && AUTH_TOKEN=t9 run"],
            ["sh", "-c", f"bash -c 'x --secret={R} y' && AUTH_TOKEN={R} run"],
        ),
        (["sh -c 'x --password=zz'"], [f"sh -c 'x --password={R}'"]),
        (["mysql", "-uroot", "-phunter2", "db"], ["mysql", "-uroot", f"-p{R}", "db"]),
        (["mysql", "-p=hunter2", "-p", "db"], ["mysql", f"-p={R}", "-p", "db"]),
        # -psecret may also be an option named "psecret": its value is withheld as well.
        (["tool", "-psecret", "v"], ["tool", f"-p{R}", R]),
        (["prog", "-port=8080", "--lr=0.1", "-c", "print(1)"], None),
    ],
)
def test_command_lines_and_short_options_are_redacted(
    argv: list[str], shown: list[str] | None
) -> None:
    assert redact_argv(argv) == (argv if shown is None else shown)


def test_command_lines_nested_deeper_than_read_are_withheld_whole() -> None:
    line = "run --password=p0ssw0rd"
    for depth in range(8):
        shown = redact_argv(["sh", "-c", line])[2]
        assert "p0ssw0rd" not in shown, (depth, shown)
        line = f"sh -c {shlex.quote(line)}"
    assert shown.rstrip("'").endswith(f"sh -c {REDACTED}")  # the line past the depth read


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    cfg = CoordinatorConfig(state_dir=":memory:", port=0, lease=600.0, heartbeat_interval=1.0)
    async with Coordinator(cfg) as c:
        yield c


async def test_getjob_withholds_a_secret_inside_sh_c(coordinator: Coordinator) -> None:
    spec = JobSpec(
        entrypoint=["sh", "-c", "exec python train.py --password=hunter2 -pdbpass-789"],
    )
    client = Client(coordinator.address, timeout=10)
    try:
        job = await asyncio.to_thread(client.submit, spec)
        shown = await asyncio.to_thread(client.get_job, job.job_id)
    finally:
        client.close()
    wire = shown.SerializeToString()
    assert b"hunter2" not in wire and b"dbpass-789" not in wire
    assert list(shown.spec.entrypoint) == [
        "sh",
        "-c",
        f"exec python train.py --password={R} -p{R}",
    ]
