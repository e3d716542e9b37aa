"""What NVML says of this host's GPUs, for the GPU tests (pynvml is imported by the caller,
which skips without it)."""

from __future__ import annotations

from typing import Any

__all__ = ["nvml_gpus"]


def nvml_gpus(pynvml: Any) -> list[tuple[str, list[int]]]:
    """(uuid, pids of its compute processes) of every GPU, in NVML's index order; the pids are
    empty where the driver does not say."""
    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            u = pynvml.nvmlDeviceGetUUID(h)
            try:
                pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            except pynvml.NVMLError:
                pids = []
            out.append((u.decode() if isinstance(u, bytes) else u, pids))
        return out
    finally:
        pynvml.nvmlShutdown()
