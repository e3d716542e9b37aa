"""The node's NVIDIA GPUs: which ones the agent offers (`--gpus`) and how healthy they are.

Discovery and sampling go through NVML (`pynvml`, from the optional `nvidia-ml-py` extra). The
module is imported lazily and can be injected, so a node without it (or without a driver) runs
as a GPU-less node, and tests drive everything with a fake module of the same shape.

`GpuMonitor.sample()` reads every offered GPU once (a few NVML calls each, no waits); the agent
runs it in a worker thread, one sample at a time, so a driver that hangs never blocks the event
loop or piles up threads. The agent only reports facts (utilization, memory, temperature, the
volatile uncorrected ECC count, lost); the coordinator decides what makes a node unhealthy.

Fault injection for tests, off unless asked for: with `GELASTIC_GPU_FAULT_FILE=PATH` in the
agent's environment, a file at PATH reading `lost N` makes GPU N read as lost, `ecc N` adds one
uncorrectable ECC error to GPU N's count (real GPUs cannot be made to fail on demand).
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any

from client.model import GpuDevice, GpuHealth
from client.node_codec import MAX_GPU_TEXT, MAX_GPUS

__all__ = [
    "FAULT_FILE_ENV",
    "MAX_GPUS",
    "GpuDevice",
    "GpuHealth",
    "GpuMonitor",
    "discover_gpus",
    "load_nvml",
    "parse_gpus",
]

logger = logging.getLogger(__name__)

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
_GPU_LIST = re.compile(r"\d{1,3}(,\d{1,3})*")
FAULT_FILE_ENV = "GELASTIC_GPU_FAULT_FILE"
_FAULT = re.compile(r"(lost|ecc) (\d{1,3})")
NVML_LIBRARY = "libnvidia-ml.so.1"
"""The driver's library, which pynvml loads (on Linux) when NVML starts."""


def parse_gpus(text: str) -> str | tuple[int, ...]:
    """`--gpus` as "auto", "none" or the indices asked for; ValueError naming the problem."""
    value = text.strip().lower()
    if value in ("auto", "none"):
        return value
    if not _GPU_LIST.fullmatch(value):
        raise ValueError(
            f"--gpus: must be auto, none or a comma-separated list of GPU indices such as "
            f"0,1,2,3; got {text[:80]!r}"
        )
    indices = tuple(int(x) for x in value.split(","))
    if len(set(indices)) != len(indices):
        dup = next(i for i in indices if indices.count(i) > 1)
        raise ValueError(f"--gpus: GPU {dup} is listed twice in {text[:80]!r}")
    if len(indices) > MAX_GPUS:
        raise ValueError(f"--gpus: at most {MAX_GPUS} GPUs, got {len(indices)}")
    return indices


def load_nvml(library: str = NVML_LIBRARY) -> Any | None:
    """The pynvml module, or None when nvidia-ml-py is not installed.

    Where the driver's `library` cannot be loaded, NVML cannot start: then a stand-in whose
    `nvmlInit` fails as pynvml's would, without importing pynvml (about 2 MB that an agent on a
    host without GPUs would otherwise keep for nothing).
    """
    import ctypes  # only when GPUs are looked for (not with --gpus none)
    import importlib.util

    try:
        if importlib.util.find_spec("pynvml") is None:
            return None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it
        return None
    try:
        ctypes.CDLL(library)
    except OSError:
        return _NvmlWithoutLibrary()
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class _NvmlError(Exception):
    """What `_NvmlWithoutLibrary.nvmlInit` raises: pynvml's NVMLError_LibraryNotFound, in shape."""

    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


class _NvmlWithoutLibrary:
    """NVML on a host without its library: it cannot start, and says so as pynvml does."""

    NVMLError = _NvmlError

    def nvmlInit(self) -> None:
        raise _NvmlError(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return "".join(c for c in str(value) if c.isprintable())[:MAX_GPU_TEXT]


def _code(exc: BaseException) -> int:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else -1


def discover_gpus(
    wanted: str | tuple[int, ...], nvml: Any | None = None, *, load: bool = True
) -> tuple[list[GpuDevice], list[Any], str]:
    """(the GPUs to offer, their NVML handles, a note saying what was found).

    "none" offers nothing. "auto" offers every GPU NVML sees, and nothing (with the note saying
    why) when pynvml is missing or NVML cannot start (no driver). A list offers exactly those
    indices: ValueError when it cannot be met (no pynvml, no driver, an index that is not here).
    `nvml` is the pynvml module to use (None: import it when `load`).
    """
    if wanted == "none":
        return [], [], "GPUs: none (--gpus none)"
    if nvml is None and load:
        nvml = load_nvml()
    if nvml is None:
        if wanted == "auto":
            return [], [], "GPUs: none (nvidia-ml-py is not installed; --gpus auto found none)"
        raise ValueError(
            "--gpus: nvidia-ml-py (module pynvml) is not installed; install gelastic[gpu] or "
            "use --gpus none"
        )
    error_type: Any = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
        count = int(nvml.nvmlDeviceGetCount())
    except error_type as exc:
        why = _text(exc) or f"NVML error {_code(exc)}"
        if wanted == "auto":
            return [], [], f"GPUs: none (NVML is not usable here: {why})"
        raise ValueError(f"--gpus: NVML is not usable here: {why}") from None
    count = max(0, min(count, MAX_GPUS))
    if wanted == "auto":
        indices: tuple[int, ...] = tuple(range(count))
    else:
        assert isinstance(wanted, tuple)
        missing = [i for i in wanted if i >= count]
        if missing:
            have = f"0-{count - 1}" if count else "none"
            raise ValueError(
                f"--gpus: GPU {missing[0]} does not exist on this node (NVML sees {count}: {have})"
            )
        indices = wanted
    devices: list[GpuDevice] = []
    handles: list[Any] = []
    for i in indices:
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            devices.append(
                GpuDevice(
                    index=i,
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    memory_total=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                )
            )
            handles.append(h)
        except error_type as exc:
            if wanted != "auto":
                raise ValueError(f"--gpus: GPU {i} cannot be read: {_text(exc)}") from None
            logger.warning("GPU %d cannot be read, not offered: %s", i, _text(exc))
    names = ", ".join(f"{d.index}={d.name}" for d in devices[:8])
    more = f" and {len(devices) - 8} more" if len(devices) > 8 else ""
    return devices, handles, f"GPUs: {len(devices)} ({names}{more})" if devices else "GPUs: none"


class GpuMonitor:
    """Samples the offered GPUs through the handles discovery got."""

    def __init__(
        self,
        nvml: Any,
        devices: list[GpuDevice],
        handles: list[Any],
        *,
        fault_file: str | None = None,
    ) -> None:
        self._nvml = nvml
        self._devices = list(zip(devices, handles, strict=True))
        self._lost: set[int] = set()
        self._fault_file = fault_file

    @property
    def devices(self) -> list[GpuDevice]:
        return [d for d, _ in self._devices]

    def sample(self) -> list[GpuHealth]:
        """One sample of every offered GPU (blocking: a handful of NVML calls per GPU)."""
        samples = [self._one(d, h) for d, h in self._devices]
        fault = self._fault()
        if fault is None:
            return samples
        kind, index = fault
        if kind == "lost":
            self._lost.add(index)
        out = []
        for s in samples:
            if s.index == index:
                s = (
                    GpuHealth(s.index, lost=True)
                    if kind == "lost"
                    else replace(s, uncorrectable_ecc=s.uncorrectable_ecc + 1)
                )
            out.append(s)
        return out

    def _fault(self) -> tuple[str, int] | None:
        if not self._fault_file:
            return None
        try:
            with open(self._fault_file, "rb") as f:
                text = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            return None
        m = _FAULT.fullmatch(text)
        return (m.group(1), int(m.group(2))) if m else None

    def _one(self, device: GpuDevice, handle: Any) -> GpuHealth:
        nvml = self._nvml
        error_type: Any = getattr(nvml, "NVMLError", Exception)
        if device.index in self._lost:
            return GpuHealth(device.index, lost=True)

        def read(fn: Any, *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except error_type as exc:
                if _code(exc) == NVML_ERROR_NOT_SUPPORTED:
                    return None
                raise

        try:
            util = read(nvml.nvmlDeviceGetUtilizationRates)
            mem = read(nvml.nvmlDeviceGetMemoryInfo)
            temp = read(nvml.nvmlDeviceGetTemperature, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            ecc = read(
                nvml.nvmlDeviceGetTotalEccErrors,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
        except error_type as exc:
            if _code(exc) != NVML_ERROR_GPU_IS_LOST:
                # Another NVML error: nothing known this time, the GPU is not called lost.
                logger.debug("GPU %d: cannot sample: %s", device.index, _text(exc))
                return GpuHealth(device.index)
            # Lost for good: NVML never gives a GPU that fell off the bus back to this process.
            logger.error("GPU %d (%s) is lost: %s", device.index, device.uuid, _text(exc))
            self._lost.add(device.index)
            return GpuHealth(device.index, lost=True)
        return GpuHealth(
            index=device.index,
            utilization_percent=float(min(100, max(0, int(util.gpu)))) if util is not None else 0.0,
            memory_used=max(0, int(mem.used)) if mem is not None else 0,
            temperature_c=int(temp) if temp is not None else 0,
            uncorrectable_ecc=max(0, int(ecc)) if ecc is not None else 0,
        )
