"""A tiny DistributedDataParallel training run, written for torchrun: it reads only the env.

Run it with `torchrun --nproc-per-node 2 examples/train_ddp.py` or under gelastic unchanged.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)
    true_w = torch.arange(8, dtype=torch.float32) / 8
    loss = torch.tensor(0.0)
    for step in range(args.steps):
        x = torch.randn(32, 8, generator=gen)
        y = x @ true_w
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  (world size {world})", flush=True)
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if rank == 0:
        print(f"mean final loss across {world} ranks: {total.item() / world:.4f}", flush=True)
    print(
        f"rank {rank}/{world} on {os.environ.get('GROUP_RANK')}:{os.environ.get('LOCAL_RANK')} done",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
