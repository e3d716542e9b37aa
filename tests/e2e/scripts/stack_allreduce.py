"""A gloo job that hangs the way real ones do: $SLOW_RANK sleeps while the others wait for it
in all_reduce. Each rank touches $OUT_DIR/ready-RANK just before; every wait is bounded."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

LIMIT_S = 120.0

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=LIMIT_S))
rank = dist.get_rank()
(Path(os.environ["OUT_DIR"]) / f"ready-{rank}").touch()
if os.environ.get("SLOW_RANK") == str(rank):
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
t = torch.tensor([float(rank)])
dist.all_reduce(t)
dist.destroy_process_group()
