"""One gloo all_reduce over `init_process_group(init_method)`, then exit without tearing down.

The same job as torch's launcher test script (`test_script_init_method.py`): every rank
contributes a one-hot vector, checks the sum equals the world size, prints "Done" and returns
without `destroy_process_group()`. That last part matters: the process group's gloo worker
thread may still hold the finished all_reduce work when the interpreter finalizes. Dropping it
then releases the tensor's Python object, which takes the GIL from a thread during
`Py_FinalizeEx`; CPython ends that thread with `pthread_exit`, whose unwinding through the
work's noexcept destructor calls `std::terminate` ("terminate called without an active
exception", SIGABRT) after the rank has done all its work. That race is inside each rank,
wherever the c10d store lives.
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
