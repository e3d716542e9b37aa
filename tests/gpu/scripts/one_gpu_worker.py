"""A worker on one GPU: what torch sees of its device, and (with $HOLD_FILE) it keeps the GPU
busy until that file exists. Writes $OUT_DIR/rank<R>.json; in a forked worker (a job with
`preload`), also whether its zygote had CUDA loaded."""

import os

import torch
from _gpu_report import hold, report

parent = os.getppid()
with open(f"/proc/{parent}/maps") as f:
    parent_has_cuda = "libcuda.so" in f.read()
bad_fork_before = torch.cuda._is_in_bad_fork()
props = torch.cuda.get_device_properties(0)
x = torch.ones(4, device="cuda").sum()
torch.cuda.synchronize()
out = {
    "sum": x.item(),
    "pid": os.getpid(),
    "parent": parent,
    "parent_has_cuda": parent_has_cuda,
    "bad_fork": bad_fork_before,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "device_uuid": str(getattr(props, "uuid", "")),
    "device_count": torch.cuda.device_count(),
    "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
}
report(out, int(os.environ["RANK"]))
hold(lambda: (x * 2).sum().item())
