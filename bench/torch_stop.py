"""torch_stop: how long a torch worker blocked in a collective takes to end after SIGTERM.

What a stop for a restart waits on. Two plain `python` processes (no launcher) form a world-2
gloo group on 127.0.0.1; rank 1 enters an `all_reduce` that rank 0 never joins, so it is
blocked inside the collective, as a healthy rank is when its peer crashed. The benchmark sends
rank 1 SIGTERM and times `waitpid` (`SIGTERM -> exit`). Then the same with rank 0 gone first
(SIGKILLed, as a crashed peer is) while rank 1 waits in its `all_reduce` (`peer dead, SIGTERM
-> exit`). Nothing here is gelastic's or torchrun's: both send this SIGTERM and then wait up to
their grace (torchrun 30 s, gelastic the spec's `stop_grace`, on every stop), so the row says
whether that grace is ever what a restart waits for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from bench._common import PY, TORCH_ENV, Measurement, RunDirs, free_port, log

SCENARIO = "torch_stop"
TIMEOUT = 120.0
SYSTEM = "worker"

_WORKER = """
import os, pathlib, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
pathlib.Path(os.environ["READY"]).touch()
if dist.get_rank() == 1:
    dist.all_reduce(t)  # rank 0 never joins: blocked in the collective
time.sleep(600)
"""


def _pair(run_dir: Path) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            **TORCH_ENV,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "READY": str(run_dir / f"ready{rank}"),
        }
        procs.append(
            subprocess.Popen(
                [PY, "-c", _WORKER],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    return procs


def _one(run_dir: Path, *, peer_dead: bool) -> float | None:
    procs = _pair(run_dir)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((run_dir / f"ready{r}").exists() for r in (0, 1)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return None
            time.sleep(0.01)
        time.sleep(0.3)  # rank 1 is inside all_reduce by now (it has nothing else to do)
        if peer_dead:
            procs[0].kill()
            procs[0].wait(10)
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        try:
            procs[1].wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def run(runs: int, quick: bool) -> list[Measurement]:
    alive = Measurement(SCENARIO, "blocked in all_reduce: SIGTERM -> exit", SYSTEM)
    dead = Measurement(SCENARIO, "peer dead, blocked in all_reduce: SIGTERM -> exit", SYSTEM)
    n = 1 if quick else runs
    with RunDirs(SCENARIO) as dirs:
        for i in range(n):
            a = _one(dirs.new("alive"), peer_dead=False)
            d = _one(dirs.new("dead"), peer_dead=True)
            alive.add(a)
            dead.add(d)
            log(f"  {SCENARIO} run {i + 1}/{n}: {a} s, peer dead {d} s")
    return [alive, dead]
