"""A script written for torchrun whose rank 1 raises after joining the gloo group."""

import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("boom from rank 1")
time.sleep(120)
