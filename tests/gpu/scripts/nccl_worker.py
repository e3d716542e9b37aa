"""A torchrun-style GPU worker: NCCL all_reduce on device LOCAL_RANK; writes what it saw to
$OUT_DIR/rank<R>.json, then (with $HOLD_FILE) keeps reducing until that file exists."""

import os

import torch
import torch.distributed as dist
from _gpu_report import hold, report

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank = dist.get_rank()
props = torch.cuda.get_device_properties(torch.cuda.current_device())
t = torch.ones(1, device="cuda") * (rank + 1)
dist.all_reduce(t)
torch.cuda.synchronize()
out = {
    "sum": t.item(),
    "local_rank": local_rank,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "device_uuid": str(getattr(props, "uuid", "")),
    "device_count": torch.cuda.device_count(),
    "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
}
report(out, rank)


def step() -> None:
    dist.all_reduce(t)
    torch.cuda.synchronize()


hold(step)
dist.destroy_process_group()
