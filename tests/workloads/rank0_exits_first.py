"""Rank 0 leaves first; the other ranks then still use the c10d store.

After one gloo all_reduce, rank 0 tears its process group down and returns. Every other rank
waits (bounded) until rank 0's process is gone, then sets and reads a key through the default
store and prints "store outlived rank 0". That only works when the store is hosted outside the
workers: when rank 0 hosts it, the store dies with rank 0 and these ranks fail (Broken pipe).
Every rank calls `destroy_process_group()`, so none of them can hit torch's exit race of a
process group left alive (see init_method.py): a failure here is about the store.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

WAIT_S = 60.0


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def main() -> None:
    dist.init_process_group(backend="gloo", init_method="env://")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank0_pid", str(os.getpid()))
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        dist.destroy_process_group()
        print("rank 0 leaves")
        return
    pid = int(store.get("rank0_pid"))
    deadline = time.monotonic() + WAIT_S
    while not gone(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 (pid {pid}) still runs after {WAIT_S:g} s")
        time.sleep(0.05)
    store.set(f"after_rank0/{rank}", "1")
    assert store.get(f"after_rank0/{rank}") == b"1"
    dist.destroy_process_group()
    print("store outlived rank 0")


if __name__ == "__main__":
    main()
