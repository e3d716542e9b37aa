"""DDP training that checkpoints every step and resumes from the checkpoint after a restart.

Each step's global batch is fixed (seeded by the step) and split evenly across ranks, so the
result does not depend on the world size: a disturbed run must end with the same parameters.
Env: CKPT_DIR, OUT_DIR, STEPS, CRASH_AT_STEP/CRASH_RANK (attempt 0 only), STEP_SLEEP.
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
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
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
            with open(os.path.join(os.environ["OUT_DIR"], "progress"), "a") as f:
                f.write(f"{attempt} {world} {step}\n")
        dist.barrier()
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


if __name__ == "__main__":
    main()
