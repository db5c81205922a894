"""Memory probes for the telemetry and the loader: what the process holds, what the device has,
how fast it moves bytes. Every figure says where it came from."""

from __future__ import annotations

import os
import platform
import time

import psutil
import torch

from engine.config import ConfigError

# Overrides the free-memory figure the loader and inspect-model compare against, in bytes:
# lets tests (and users on shared machines) exercise "does not fit" without a huge model.
AVAILABLE_MEMORY_ENV = "KVSCOPE_AVAILABLE_MEMORY_BYTES"


def _nvml_total_bytes(device: torch.device) -> int | None:
    """The GPU's total memory as the driver reports it, or None where NVML is not importable
    or not answering (no driver, a container without it)."""
    try:
        # NVIDIA's library: optional, absent on machines without a GPU
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def probe_memory(device: torch.device) -> tuple[int, int, int, str]:
    """(process_bytes, reserved_bytes, total_bytes, source) for the device the model lives on.

    CUDA: the caching allocator's allocated and reserved bytes, the card's total (NVML when
    present, else torch's device properties). CPU: the process RSS (twice: the OS has no separate
    "reserved" figure) and the machine's RAM."""
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        total = _nvml_total_bytes(device)
        if total is not None:
            return allocated, reserved, total, "torch.cuda allocator, NVML total"
        total = torch.cuda.get_device_properties(device).total_memory
        return allocated, reserved, total, "torch.cuda allocator"
    rss = psutil.Process().memory_info().rss
    return rss, rss, psutil.virtual_memory().total, "psutil RSS"


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` could still get: free GPU memory, or the RAM the OS
    calls available. $KVSCOPE_AVAILABLE_MEMORY_BYTES overrides both."""
    override = os.environ.get(AVAILABLE_MEMORY_ENV)
    if override:
        try:
            return int(override)
        except ValueError:
            raise ConfigError(
                f"{AVAILABLE_MEMORY_ENV} must be a whole number of bytes, got {override!r}"
            ) from None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def measure_memory_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second moved by a device-to-device copy of `nbytes`, best of `repeats`.

    A copy reads and writes every byte, so the figure counts 2 x nbytes per copy. Best-of-N
    because the floor is what decode can hope for; a slower run measures interference."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up: page faults, allocator, kernel launch
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_name(device: torch.device) -> str:
    """A human name for the device: the GPU's name, or the CPU model and its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    return f"{_cpu_model_name()} ({cores} threads)"
