"""DDP training that checkpoints every step and resumes from the checkpoint after a restart.

Each step's global batch is fixed (seeded by the step) and split evenly across ranks, so the
result does not depend on the world size: a disturbed run must end with the same parameters.
Env: CKPT_DIR, OUT_DIR, STEPS, CRASH_AT_STEP/CRASH_RANK (attempt 0 only), STEP_SLEEP.

Since the result cannot tell a resume from a fresh start, each rank also appends to
$OUT_DIR/resumes the step of the checkpoint it loaded ("attempt round world loaded", -1 = none),
and rank 0 appends "attempt world step round" to $OUT_DIR/progress after each step's checkpoint.
With $HOLD_AT_STEP, every rank stops after that step's checkpoint (rank 0 writes
$OUT_DIR/holding) until $OUT_DIR/go exists, or exits 3 after $HOLD_TIMEOUT s (default 120):
a test can then disturb the job at a known step instead of racing a sleep.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 12  # divisible by every world size used (2, 4, 6)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ckpt = os.path.join(os.environ["CKPT_DIR"], "ckpt.pt")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    round_ = os.environ.get("GELASTIC_ROUND", "0")
    out_dir = os.environ["OUT_DIR"]
    start = 0
    loaded = -1
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loaded = state["step"]
        start = loaded + 1
    _append(os.path.join(out_dir, "resumes"), f"{attempt} {round_} {world} {loaded}\n")
    ddp = DistributedDataParallel(model)
    steps = int(os.environ.get("STEPS", "20"))
    per = GLOBAL_BATCH // world
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(GLOBAL_BATCH, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp"
            )
            os.replace(ckpt + ".tmp", ckpt)
            _append(os.path.join(out_dir, "progress"), f"{attempt} {world} {step} {round_}\n")
        dist.barrier()
        if step == int(os.environ.get("HOLD_AT_STEP", "-1")):
            _hold(rank, step, out_dir, f"{attempt} {round_} {step}\n")
        if (
            attempt == 0
            and str(rank) == os.environ.get("CRASH_RANK")
            and step == int(os.environ.get("CRASH_AT_STEP", "-1"))
        ):
            print(f"rank {rank} crashing at step {step}", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(os.environ["OUT_DIR"], "final.pt"))
    dist.destroy_process_group()


def _append(path: str, line: str) -> None:
    """One O_APPEND write: lines of concurrent ranks never mix."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _hold(rank: int, step: int, out_dir: str, what: str) -> None:
    go = os.path.join(out_dir, "go")
    if rank == 0:
        _append(os.path.join(out_dir, "holding"), what)
    deadline = time.monotonic() + float(os.environ.get("HOLD_TIMEOUT", "120"))
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            print(f"rank {rank}: nobody said go after step {step}", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
