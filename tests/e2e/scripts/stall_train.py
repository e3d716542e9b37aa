"""A gloo training loop that reports progress; rank $HANG_RANK hangs at step $HANG_STEP on the
first attempt while the others enter that step's all_reduce (it writes $OUT_DIR/hung first)."""

import os
import time

import torch
import torch.distributed as dist

from client import progress

STEPS = int(os.environ.get("STEPS", "12"))
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_STEP = int(os.environ.get("HANG_STEP", "5"))
first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(STEPS):
    if rank == HANG_RANK and step == HANG_STEP and first_attempt:
        with open(os.path.join(os.environ["OUT_DIR"], "hung"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)  # the hang under test: killed by the job's stop
    progress(step, loss=1.0 / (step + 1))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
