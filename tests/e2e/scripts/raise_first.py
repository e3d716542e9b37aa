"""Rank $RAISE_RANK raises ValueError after the first barrier; the others wait in all_reduce and
crash on the broken collective. With $USE_RECORD=1 main is wrapped in torch's own @record.

Peers ignore SIGTERM for a while so that they fail on their own (collateral) instead of being
stopped by the agent first.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    dist.barrier()
    if rank == int(os.environ["RAISE_RANK"]):
        time.sleep(0.2)
        print(f"rank {rank} about to raise", file=sys.stderr, flush=True)
        raise ValueError(f"boom from rank {rank}")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    t = torch.ones(1)
    dist.all_reduce(t)  # raises once the raising rank's process is gone
    time.sleep(30)


if __name__ == "__main__":
    if os.environ.get("USE_RECORD") == "1":
        record(main)()
    else:
        main()
