"""Rank $RAISE_RANK raises under torch's @record, then tears down slowly (an atexit handler of
$TEARDOWN_S seconds) before it would exit; the other ranks wait in all_reduce.

Before raising it writes $OUT_DIR/raised_at (epoch seconds); the atexit handler writes
$OUT_DIR/teardown_done when its slow teardown ends.
"""

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

OUT = os.environ["OUT_DIR"]


def slow_teardown() -> None:
    end = time.monotonic() + float(os.environ.get("TEARDOWN_S", "3"))
    while time.monotonic() < end:
        time.sleep(0.05)  # what a slow interpreter/torch teardown looks like from outside
    with open(os.path.join(OUT, "teardown_done"), "w") as f:
        f.write(str(time.time()))


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.barrier()
    if rank == int(os.environ["RAISE_RANK"]):
        atexit.register(slow_teardown)
        with open(os.path.join(OUT, "raised_at"), "w") as f:
            f.write(repr(time.time()))
        raise ValueError(f"boom from rank {rank}")
    dist.all_reduce(torch.ones(1))  # breaks once the raising rank is gone
    time.sleep(60)


if __name__ == "__main__":
    main()
