"""A script written for torchrun: gloo all_reduce of the ranks, then one line per rank."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(
    f"rank {rank} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {t.item()}",
    flush=True,
)
dist.destroy_process_group()
