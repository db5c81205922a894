"""The runtime's own memory, measured: what a process running an engine holds beside the weights
and the KV pool (Python, torch and transformers, the tokenizer, the GGUF reader; in the app, Qt
too), so a fit estimate counts it instead of a guess.

- In a process that has loaded a model: its resident set now, less the running engine's weights
  and pool, which the next load replaces (the engine thread hands a load's freed copies back to
  the OS, `give_back_freed_memory`, and the app does the same with a replaced engine before the
  next load, so what is freed does not stay counted).
- In a process that has not: its resident set now, plus what a first load added beyond its
  weights and pool when this kind of process (the app, the headless engine) last measured one on
  this machine, kept in kvscope's cache. The engine thread measures every load
  (engine/core/service.py: resident set before and after).
- The KV pool: where it fills lazily (on the CPU: engine.model.kv_storage.fills_lazily) its
  pages become resident only as blocks are written, so a load's process holds the runtime and
  the weights, and grows toward the whole pool as the cache fills; both figures are given. What
  a running engine's pool holds is what of it is resident now (mincore), not its size.
What is left out: a model whose own tokenizer and metadata are much larger than the last one's
adds their difference (on the packaged model after a tiny one, ~170 MiB of ~830).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from engine.cache_dirs import cache_root

if TYPE_CHECKING:
    import torch


class Pool(Protocol):
    """What of a KV pool (engine.model.kv_storage.PagedKVStorage) the measurement reads."""

    kv: list[torch.Tensor]
    k_scale: list[torch.Tensor]
    v_scale: list[torch.Tensor]


FILE_NAME = "runtime-memory.json"

_lock = threading.Lock()
_state: dict[str, Any] = {
    "held": None,  # the running engine's weights (+ its pool, see "pool"): 0 when none, None before any
    "pool": None,  # a weak reference to the running engine's pool: what of it is resident is held too
}


@dataclass(frozen=True, slots=True)
class RuntimeEstimate:
    process_now: int  # this process's resident set now
    last_held: (
        int | None
    )  # of this process's running engine, its weights and resident pool (0: none); None before any load
    first_load_overhead: int  # what a first load adds, measured on this machine (0: not yet)
    source: str  # where the figures come from, for the user
    pool_lazy: bool  # a new CPU pool here fills lazily: resident only as the cache fills

    def process_with(self, weight_bytes: int, pool_bytes: int) -> int:
        """The process once a load of these weights and this pool has taken place (the pool
        counted only where it is resident at once)."""
        resident = weight_bytes + (0 if self.pool_lazy else pool_bytes)
        return estimate_process(self.process_now, self.last_held, self.first_load_overhead, resident)

    def as_dict(self, weight_bytes: int, pool_bytes: int) -> dict[str, object]:
        at_load = self.process_with(weight_bytes, pool_bytes)
        runtime = at_load - weight_bytes - (0 if self.pool_lazy else pool_bytes)
        return {
            "runtime_bytes": runtime,
            "process_bytes": at_load,  # once loaded
            "process_full_pool_bytes": runtime + weight_bytes + pool_bytes,  # its KV pool all written
            "pool_fills_lazily": self.pool_lazy,
            "runtime_process_now_bytes": self.process_now,
            "runtime_last_held_bytes": self.last_held,
            "runtime_first_load_bytes": self.first_load_overhead,
            "runtime_source": self.source,
        }


def estimate_process(process_now: int, last_held: int | None, first_load: int, new_bytes: int) -> int:
    """The process's resident set after a load whose weights and pool make `new_bytes` resident:
    now, less the running engine's resident bytes where this process loaded before (the new ones
    take their place), else plus what a first load adds; plus the new bytes."""
    if last_held is not None:
        return max(0, process_now - last_held) + new_bytes
    return process_now + first_load + new_bytes


def process_kind() -> str:
    """'app' inside the desktop app (Qt loaded), else 'headless': their runtimes differ by Qt."""
    return "app" if "PySide6.QtWidgets" in sys.modules else "headless"


def resident_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def _file() -> Path:
    return cache_root() / FILE_NAME


def _stored() -> dict[str, dict[str, object]]:
    try:
        raw = json.loads(_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _resident_bytes(libc: Any, address: int, length: int) -> int | None:
    """Bytes of the pages over [address, address + length) resident now (mincore), None if the
    kernel would not say."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    pages = -(-(address + length - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), vec) != 0:
        return None
    return sum(v & 1 for v in vec) * page


def resident_in(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' memory resident now (mincore on their pages): a lazily filled
    pool holds only the pages its written blocks touched. Where it cannot be asked (not Linux),
    their whole size."""
    tensors = list(tensors)
    whole = sum(t.numel() * t.element_size() for t in tensors)
    if not sys.platform.startswith("linux"):
        return whole
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        resident = 0
        for t in tensors:
            part = _resident_bytes(libc, t.data_ptr(), t.numel() * t.element_size())
            if part is None:
                return whole
            resident += part
        return min(resident, whole)
    except (OSError, AttributeError, ValueError):
        return whole


def cached_share(path: Path) -> float | None:
    """The share of a file's pages in the page cache now (mincore over a read-only mapping of
    it, which reads nothing): a load of a file the cache holds reads memory, of one it does not,
    the disk (the same 8B-shaped file loaded in 5.5 s one run and 16.8 s another). None where
    it cannot be asked (not Linux, an empty or unreadable file)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        size = path.stat().st_size
        if size == 0:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            resident = _resident_bytes(libc, address, size)
        finally:
            libc.munmap(address, size)
        return None if resident is None else min(1.0, resident / size)
    except (OSError, AttributeError, ValueError):
        return None


def pool_resident(pool: Pool) -> int:
    return resident_in([*pool.kv, *pool.k_scale, *pool.v_scale])


def _held_now() -> int | None:
    """The running engine's weights and what of its pool is resident now."""
    held, ref = _state["held"], _state["pool"]
    pool = ref() if ref is not None else None
    return None if held is None else held + (pool_resident(pool) if pool is not None else 0)


def record_load(before: int, after: int, weight_bytes: int, pool: Pool, model: str) -> int:
    """A load measured around (resident set before and after, in bytes). The first of the
    process is kept for its kind: what a first load adds beyond its weights and the part of its
    pool resident by then. Returns it."""
    overhead = max(0, after - before - weight_bytes - pool_resident(pool))
    with _lock:
        first = _state["held"] is None
        _state["held"], _state["pool"] = weight_bytes, weakref.ref(pool)
        if first:
            _store(process_kind(), overhead, model)
    return overhead


def give_back_freed_memory() -> None:
    """Return the heap memory a load freed to the OS. A load makes hundreds of MB of short-lived
    copies (a GGUF's decoded codes and scales, dequantized tensors); glibc keeps what they leave
    for reuse, so the process would stay that much larger than its runtime, weights and pool
    (measured on the packaged model: 1239 -> 828 MiB). No Python garbage collection here: this
    runs on the engine thread, where collecting the GUI's objects is not allowed."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to ask
        ctypes.CDLL(None).malloc_trim(0)


def engine_holds(weight_bytes: int, pool: Pool) -> None:
    """An engine of this process holds these weights and this pool (one it did not load itself)."""
    with _lock:
        _state["held"], _state["pool"] = weight_bytes, weakref.ref(pool)


def engine_released() -> None:
    """The engine stopped: its weights and pool leave the process once nothing refers to them
    (`release_now` in the app, where the replaced engine would wait for the garbage collector)."""
    with _lock:
        if _state["held"] is not None:
            _state["held"], _state["pool"] = 0, None


def _store(kind: str, overhead: int, model: str) -> None:
    stored = _stored()
    stored[kind] = {"first_load_overhead_bytes": overhead, "model": model, "measured_at": time.time()}
    try:
        path = _file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache: the next fresh process measures its own


def runtime_estimate(device: str = "cpu") -> RuntimeEstimate:
    """The measured figures a new load's process estimate is made of (RuntimeEstimate.process_with),
    for a load on `device`."""
    from engine.model.kv_storage import fills_lazily  # torch: only once an estimate is asked for

    kind = process_kind()
    lazy = fills_lazily(device)
    give_back_freed_memory()  # what the allocator keeps of freed memory is no part of the runtime
    now = resident_bytes()
    with _lock:
        held = _held_now()
    if held is not None:
        return RuntimeEstimate(
            now,
            held,
            0,
            "this process now, its last model's weights and KV pool replaced (measured)",
            lazy,
        )
    entry = _stored().get(kind, {})
    value = entry.get("first_load_overhead_bytes")
    if isinstance(value, int):
        source = f"this process now + what a first {kind} load added here ({entry.get('model')}, measured)"
        return RuntimeEstimate(now, None, value, source, lazy)
    return RuntimeEstimate(
        now, None, 0, "this process now (no load measured here yet: a first load adds to it)", lazy
    )
