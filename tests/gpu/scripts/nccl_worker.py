"""A torchrun-style GPU worker: NCCL all_reduce on device LOCAL_RANK; writes what it saw to
$OUT_DIR/rank<R>.json, then (with $HOLD_FILE) keeps reducing until that file exists."""

import json
import os
import time

import torch
import torch.distributed as dist

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
path = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
hold = os.environ.get("HOLD_FILE")
deadline = time.monotonic() + 300
while hold and not os.path.exists(hold) and time.monotonic() < deadline:
    dist.all_reduce(t)
    torch.cuda.synchronize()
    time.sleep(0.2)
dist.destroy_process_group()
