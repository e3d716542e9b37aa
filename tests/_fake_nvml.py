"""A stand-in for the `pynvml` module (nvidia-ml-py) with the same names and call shapes.

Only the NVML layer (nodeagent/_gpus.py) is replaced: what the agent and the coordinator do
with the devices it reports is the real code. Tests change the fake's state (a GPU lost, an
ECC error, a driver that is not loaded) and watch the agent and the coordinator react.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """pynvml.NVMLError: the NVML return code is in `value`."""

    _TEXT = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._TEXT.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    memory_total: int = 40 * 2**30
    memory_used: int = 512 * 2**20
    util: int = 7
    temperature: int = 41
    ecc_uncorrected: int = 0
    ecc_supported: bool = True
    lost: bool = False


class FakeNvml:
    """A module-like object: pass it where the agent takes its `nvml`."""

    NVMLError = NVMLError

    def __init__(self, count: int = 2, *, driver_loaded: bool = True) -> None:
        self.gpus = [FakeGpu(uuid=f"GPU-{i:08x}-fake-0000-0000-{i:012x}") for i in range(count)]
        self.driver_loaded = driver_loaded
        self.initialized = False
        self.calls = 0
        self._lock = threading.Lock()  # sampled from a worker thread
        for name, value in globals().items():
            if name.startswith("NVML_"):
                setattr(self, name, value)

    def _gpu(self, handle: Any) -> FakeGpu:
        with self._lock:
            self.calls += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        gpu: FakeGpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return SimpleNamespace(index=index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        g = self._gpu(handle)
        return SimpleNamespace(
            total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used
        )

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        g = self._gpu(handle)
        return SimpleNamespace(gpu=g.util, memory=g.util // 2)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._gpu(handle).temperature

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        g = self._gpu(handle)
        assert (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        if not g.ecc_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.ecc_uncorrected
