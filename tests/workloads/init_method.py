"""One gloo all_reduce over `init_process_group(init_method)`, then exit without tearing down.

The same job as torch's launcher test script (`test_script_init_method.py`): every rank
contributes a one-hot vector, checks the sum equals the world size, prints "Done" and returns
without `destroy_process_group()`. That last part is the point: the process group's background
threads are still running at interpreter exit, which is where a store that vanishes under them
(rank 0 exiting first while it hosts the store) turns a finished job into a SIGABRT.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--init-method", "--init_method", required=True, help="e.g. env://")
    parser.add_argument("--world-size", "--world_size", type=int, default=None)
    parser.add_argument("--rank", type=int, default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    world_size = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    dist.init_process_group(
        backend="gloo", init_method=args.init_method, world_size=world_size, rank=rank
    )
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    t = F.one_hot(torch.tensor(rank), num_classes=world_size)
    dist.all_reduce(t)
    derived = int(torch.sum(t).item())
    if derived != world_size:
        raise RuntimeError(f"Wrong world size derived. Expected: {world_size}, Got: {derived}")
    print("Done")


if __name__ == "__main__":
    main()
