"""GPU telemetry through NVML (``nvidia-ml-py``, imported as ``pynvml``): clocks, power, temperature,
utilization and memory of one device -- what ``--log-gpu-util N`` records every N steps.

``gpu_stats(index)`` returns a flat dict (keys in ``STAT_KEYS``; a value NVML cannot report on this GPU is
None) or None when there is no NVML library, no driver, or no such device: on a CPU machine it returns
None without raising. NVML is initialised once per process and left initialised.

NVML numbers devices in its own order (PCI bus order) and ignores ``CUDA_VISIBLE_DEVICES``; torch numbers
them in CUDA's order among the visible ones. ``nvml_index_for_torch_device(device)`` maps a torch CUDA
device to its NVML index through the PCI bus id, so a worker logs the GPU it actually runs on.
"""

from __future__ import annotations

from typing import Any, Optional

# Keys of the dict gpu_stats returns (units in the names).
STAT_KEYS = ("index", "name", "sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w",
             "temperature_c", "gpu_util_pct", "mem_util_pct", "memory_used_bytes", "memory_total_bytes",
             "throttle_reasons")

_STATE: dict[str, Any] = {"nvml": None, "failed": False}


def _nvml():
    """The initialised pynvml module, or None (not installed, no driver, init failed). Cached."""
    if _STATE["nvml"] is not None:
        return _STATE["nvml"]
    if _STATE["failed"]:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError (no driver/library), OSError
        _STATE["failed"] = True
        return None
    _STATE["nvml"] = pynvml
    return pynvml


def _reset_for_tests() -> None:
    """Forget the cached NVML state (tests that swap in a fake pynvml)."""
    _STATE.update(nvml=None, failed=False)


def _try(fn, *args, scale: float = 1.0):
    try:
        v = fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported etc.: this GPU does not report it
        return None
    return v * scale if scale != 1.0 else v


def gpu_stats(index: int = 0) -> Optional[dict]:
    """One sample of NVML device ``index``: see ``STAT_KEYS``; None when NVML or the device is unavailable."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(int(index))
    except Exception:  # noqa: BLE001 - no such device
        return None
    name = _try(nv.nvmlDeviceGetName, handle)
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    util = _try(nv.nvmlDeviceGetUtilizationRates, handle)
    mem = _try(nv.nvmlDeviceGetMemoryInfo, handle)
    return {
        "index": int(index),
        "name": name,
        "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM),
        "max_sm_clock_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
        "power_w": _try(nv.nvmlDeviceGetPowerUsage, handle, scale=1e-3),            # NVML reports mW
        "power_limit_w": _try(nv.nvmlDeviceGetEnforcedPowerLimit, handle, scale=1e-3),
        "temperature_c": _try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
        "gpu_util_pct": None if util is None else util.gpu,
        "mem_util_pct": None if util is None else util.memory,
        "memory_used_bytes": None if mem is None else int(mem.used),
        "memory_total_bytes": None if mem is None else int(mem.total),
        "throttle_reasons": _try(nv.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
        else _try(nv.nvmlDeviceGetCurrentClocksThrottleReasons, handle),
    }


def nvml_index_for_torch_device(device) -> Optional[int]:
    """NVML index of a torch CUDA device (int index or torch.device), matched by PCI bus id; None when
    NVML or CUDA is unavailable or no NVML device matches."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        import torch

        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(dev.index if dev.index is not None else torch.cuda.current_device())
        want = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        for i in range(nv.nvmlDeviceGetCount()):
            pci = nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByIndex(i))
            if (pci.domain, pci.bus, pci.device) == want:
                return i
    except Exception:  # noqa: BLE001
        return None
    return None


class GpuUtilLogger:
    """Samples ``gpu_stats`` every ``every_n_steps`` optimizer steps (0: never) -- ``--log-gpu-util N``.

    ``maybe_sample(step)`` returns the sample dict (with "step") when ``step`` (1-based steps done) is a
    multiple of N and a GPU is there, else None. Built for a torch device it resolves the NVML index once."""

    def __init__(self, every_n_steps: int, device=None, index: Optional[int] = None):
        self.every = max(int(every_n_steps), 0)
        self.index = index
        if self.index is None and self.every and device is not None:
            self.index = nvml_index_for_torch_device(device)

    def maybe_sample(self, step: int) -> Optional[dict]:
        if not self.every or self.index is None or step % self.every:
            return None
        s = gpu_stats(self.index)
        return None if s is None else {"step": int(step), **s}
