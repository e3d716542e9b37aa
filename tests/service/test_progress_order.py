"""`gelastic submit --watch` prints its progress in the order things happened: no status line
older than the event printed just before it.

A real coordinator in-process, two scripted agents, and the real CLI as a subprocess whose
stderr is read line by line, so each step of the round is taken only once the CLI showed the
one before.
"""

from __future__ import annotations

import asyncio
import os
import sys

from coordinator.server import Coordinator, CoordinatorConfig
from tests.service._fakes import FakeNode, run_round, worker_exit

WAIT_S = 30.0


async def _line_with(stream: asyncio.StreamReader, text: str, seen: list[str]) -> str:
    while True:
        raw = await asyncio.wait_for(stream.readline(), WAIT_S)
        assert raw, f"the CLI ended before printing {text!r}: {seen}"
        line = raw.decode().rstrip("\n")
        seen.append(line)
        if text in line:
            return line


async def test_watch_prints_nothing_older_than_the_round_it_said_formed() -> None:
    async with Coordinator(CoordinatorConfig(state_dir=":memory:", port=0, lease=600)) as c:
        a = FakeNode(c.address, "node-a", "127.0.0.1", slots=2)
        b = FakeNode(c.address, "node-b", "127.0.0.2", slots=2)
        await a.connect()
        await b.connect()
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gelastic",
            "--coordinator",
            c.address,
            "submit",
            "--watch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--",
            "python",
            "t.py",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "GELASTIC_TOKEN_FILE": ""},
        )
        try:
            assert cli.stderr is not None and cli.stdout is not None
            seen: list[str] = []
            # The round formed; node-a is asked for a master port and holds its answer.
            await _line_with(cli.stderr, "round 1 formed with 2 nodes", seen)
            aa, ab = await run_round(a, b)
            for node, asg in ((a, aa), (b, ab)):
                for w in asg.workers:
                    await node.outbox.put(worker_exit(asg, w.local_rank, 0))
            await _line_with(cli.stderr, "succeeded", seen)
            rest = await asyncio.wait_for(cli.stderr.read(), WAIT_S)
            code = await asyncio.wait_for(cli.wait(), WAIT_S)
        finally:
            if cli.returncode is None:
                cli.kill()
                await cli.wait()
            await a.close()
            await b.close()
        err = "\n".join(seen) + rest.decode()
        assert code == 0, err
        formed = next(i for i, line in enumerate(seen) if "round 1 formed" in line)
        # Before: "[job-...] rendezvous: queued" came next, a snapshot from before the round.
        after = seen[formed + 1 :]
        assert after and all("attempt 0" in line or "succeeded" in line for line in after), err
        assert not any("rendezvous" in line or "queued" in line for line in after), err
