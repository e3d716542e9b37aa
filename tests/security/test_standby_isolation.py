"""A standby worker holds nothing of a round before its hand-off, and takes one only from its agent.

Before the hand-off a standby has none of the round's variables (rank, master, error file, the
job's result key never was in env) and its hand-off channel is an inherited pipe, not a path
anyone could write; a hand-off that is not well-formed runs nothing.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from client.model import JobSpec
from nodeagent._launch import build_standby_launch
from nodeagent._standby import StandbyPool

ROOT = Path(__file__).resolve().parents[2]
ROUND_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    "GELASTIC_ROUND",
)


def test_a_standby_has_no_round_and_reads_its_handoff_from_an_inherited_pipe(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    spec = JobSpec(
        entrypoint=[sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
        nproc_per_node=1,
        env={"JOB_VAR": "1"},
        preload=("json",),
        result_key=os.urandom(32),
    )
    agent_env = {k: v for k, v in os.environ.items() if k not in ROUND_VARS}

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(spec, agent_env=agent_env, agent_cwd=str(tmp_path))
        assert launch is not None
        pool.fill("job-1", launch, 1)
        assert await pool.warm("job-1") == 1
        (standby,) = pool._jobs["job-1"].idle
        pid = standby.handle.pid
        env = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in item
        )
        assert env["JOB_VAR"] == "1"
        assert not [k for k in ROUND_VARS if k in env]
        assert spec.result_key.hex() not in "".join(env.values())
        # Forked by the job's zygote: once it has set itself up it holds stdin, its two output
        # pipes and the hand-off pipe (descriptor 3), nothing else of the zygote's or the agent's.
        fds: list[int] = []
        for _ in range(500):
            fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
            if fds == [0, 1, 2, 3]:
                break
            await asyncio.sleep(0.02)
        assert fds == [0, 1, 2, 3]
        assert os.readlink(f"/proc/{pid}/fd/3").startswith("pipe:")
        # Not well-formed: the standby refuses it (usage exit) and runs nothing.
        assert standby.wfd is not None
        os.write(standby.wfd, b'{"argv": ["--code", "x"], "env": {"A=B": "1"}}')
        os.close(standby.wfd)
        standby.wfd = None
        code = await asyncio.wait_for(standby.handle.wait(), 30)
        assert code == 2
        assert not marker.exists()
        pool.discard("job-1")
        await pool.close()  # and the zygote it was forked from

    asyncio.run(main())
