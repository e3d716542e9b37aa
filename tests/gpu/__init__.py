"""End-to-end tests on real NVIDIA GPUs (one GPU; NCCL on two). Collected only where a GPU is
present, or when GELASTIC_GPU_TESTS=1 (`make test-gpu`, `tests/gpu/run_on_gpu_host.sh`); see
tests/conftest.py and tests/gpu/README.md."""

from __future__ import annotations

import glob
import os

__all__ = ["GPU_TESTS_ENV", "nvidia_gpu_present"]

GPU_TESTS_ENV = "GELASTIC_GPU_TESTS"


def nvidia_gpu_present() -> bool:
    """Whether the NVIDIA driver shows a GPU on this host (cheap: no torch, no NVML)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(
        os.path.isdir("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus")
    )
