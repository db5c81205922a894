"""The device's two roofs, measured on this machine: peak matmul FLOP/s for a dtype and memory
bandwidth. Their ratio is the ridge point, the arithmetic intensity (FLOP/byte) where a step
stops being memory-bound and becomes compute-bound. Never a spec-sheet figure: a CPU's peak
depends on its vector units, threads and the dtype's kernels (bf16 without native bf16 math is
many times slower than fp32), and only a measurement knows.

Measuring takes a few seconds, so results are cached per device and dtype as JSON in kvscope's
cache dir, and re-measured on request or when the device behind the key changed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.cache_dirs import cache_root
from engine.config import ConfigError
from engine.measure.device import TORCH_DTYPES, resolve_device
from engine.measure.memory import device_name, measure_memory_bandwidth
from engine.private import private_dir
from engine.results import DeviceLimits

# Square matmul sizes tried in order, up to the first that gets slow. The best size differs by
# device: a CPU can peak at a size whose operands stay in its caches (512 on a 2-core EPYC,
# measured) and run slower at larger ones; a GPU needs thousands to fill its units. So the
# ladder does not stop at the first size that fails to improve (on a busy machine that is often
# noise) but keeps the best of all sizes it tries.
MATMUL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
# Stop climbing once a single matmul takes this long: the next size is 8x the work, and a
# measurement the user waits for should stay within seconds (bf16 on a CPU without bf16 units
# runs at a few GFLOP/s).
SLOW_MATMUL_S = 0.1
# Best of several: interference only ever makes a run slower.
MATMUL_REPEATS = 5
# Far larger than any CPU's last-level cache, so the copy streams from DRAM; small enough to be quick.
BANDWIDTH_BYTES = 256 * 2**20
CACHE_FORMAT = 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_matmul_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """(best FLOP/s, the size n that reached it) over n x n matmuls of growing size, up to the
    first whose fastest run takes longer than SLOW_MATMUL_S.

    The product is x @ w.T with w stored [out, in], the layout of every nn.Linear: on CPUs
    without native bf16, plain x @ w in bf16 takes a generic path ~10x slower than the one
    F.linear uses (measured), which would put the roof far below what the model achieves."""
    best_flops, best_size = 0.0, 0
    for n in MATMUL_SIZES:
        x = torch.randn(n, n, device=device).to(dtype)
        w = torch.randn(n, n, device=device).to(dtype)
        torch.nn.functional.linear(x, w)  # warm-up: kernel selection, allocator, page faults
        _sync(device)
        fastest = float("inf")
        for _ in range(MATMUL_REPEATS):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            _sync(device)
            fastest = min(fastest, time.perf_counter() - start)
        flops = 2 * n**3 / fastest
        if flops > best_flops:
            best_flops, best_size = flops, n
        if fastest > SLOW_MATMUL_S:
            break
    return best_flops, best_size


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _resolve(device: str | torch.device) -> torch.device:
    return device if isinstance(device, torch.device) else resolve_device(device)


def measure_device_limits(device: str | torch.device, dtype: str) -> DeviceLimits:
    """Measure the matmul peak in `dtype` and the memory bandwidth of `device` now (seconds)."""
    torch_dtype = _torch_dtype(dtype)
    dev = _resolve(device)
    start = time.perf_counter()
    peak, size = measure_matmul_peak(dev, torch_dtype)
    bandwidth = measure_memory_bandwidth(dev, BANDWIDTH_BYTES)
    return DeviceLimits(
        device=str(dev),
        device_name=device_name(dev),
        dtype=dtype,
        peak_flops=peak,
        matmul_size=size,
        bandwidth=bandwidth,
        threads=torch.get_num_threads(),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        measure_seconds=time.perf_counter() - start,
    )


def cache_path(device: torch.device, dtype: str) -> Path:
    key = device.type if device.index is None else f"{device.type}{device.index}"
    return cache_root() / "device-limits" / f"{key}-{dtype}.json"


def _read_cached(path: Path, device: torch.device) -> DeviceLimits | None:
    """The cached limits, or None when absent, unreadable, of another format, or measured on a
    different device or thread count than now (another GPU in the slot, a changed thread setting)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.pop("format", None) != CACHE_FORMAT:
            return None
        raw.pop("ridge_flops_per_byte", None)
        limits = DeviceLimits(**raw)
    except (OSError, ValueError, TypeError):
        return None
    if limits.device_name != device_name(device) or limits.threads != torch.get_num_threads():
        return None
    return limits


def _write_cached(path: Path, limits: DeviceLimits) -> None:
    """Write through a temp file and a rename, so a reader never sees half a file."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": CACHE_FORMAT, **limits.to_dict()}, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_measure(device: str | torch.device, dtype: str, refresh: bool = False) -> DeviceLimits:
    """The cached limits of `device` in `dtype`, measuring (and caching) them when there are none
    yet, the cache is stale, or `refresh` asks for a new measurement."""
    _torch_dtype(dtype)
    dev = _resolve(device)
    path = cache_path(dev, dtype)
    if not refresh:
        cached = _read_cached(path, dev)
        if cached is not None:
            return cached
    limits = measure_device_limits(dev, dtype)
    _write_cached(path, limits)
    return limits
