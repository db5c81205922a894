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
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.cache_dirs import cache_root

FILE_NAME = "runtime-memory.json"

_lock = threading.Lock()
_state: dict[str, int | None] = {
    "held": None,  # what this process's running engine holds (weights + pool): 0 when none, None before any
}


@dataclass(frozen=True, slots=True)
class RuntimeEstimate:
    process_now: int  # this process's resident set now
    last_held: int | None  # weights + pool of this process's running engine (0: none); None before any load
    first_load_overhead: int  # what a first load adds, measured on this machine (0: not yet)
    source: str  # where the figures come from, for the user

    def process_with(self, new_bytes: int) -> int:
        """The process once a load of `new_bytes` (its weights and pool) has taken place."""
        return estimate_process(self.process_now, self.last_held, self.first_load_overhead, new_bytes)

    def as_dict(self, new_bytes: int) -> dict[str, object]:
        return {
            "runtime_bytes": self.process_with(new_bytes) - new_bytes,
            "process_bytes": self.process_with(new_bytes),
            "runtime_process_now_bytes": self.process_now,
            "runtime_last_held_bytes": self.last_held,
            "runtime_first_load_bytes": self.first_load_overhead,
            "runtime_source": self.source,
        }


def estimate_process(process_now: int, last_held: int | None, first_load: int, new_bytes: int) -> int:
    """The process's resident set after a load of `new_bytes` of weights and pool: now, less the
    running engine's bytes where this process loaded before (the new ones take their place), else
    plus what a first load adds; plus the new bytes."""
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


def record_load(before: int, after: int, weight_bytes: int, pool_bytes: int, model: str) -> int:
    """A load measured around (resident set before and after, in bytes). The first of the
    process is kept for its kind: what a first load adds beyond its weights and pool. Returns it."""
    overhead = max(0, after - before - weight_bytes - pool_bytes)
    with _lock:
        first = _state["held"] is None
        _state["held"] = weight_bytes + pool_bytes
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


def engine_holds(nbytes: int) -> None:
    """An engine of this process holds `nbytes` of weights and pool (one it did not load itself)."""
    with _lock:
        _state["held"] = nbytes


def engine_released() -> None:
    """The engine stopped: its weights and pool leave the process once nothing refers to them
    (`release_now` in the app, where the replaced engine would wait for the garbage collector)."""
    with _lock:
        if _state["held"] is not None:
            _state["held"] = 0


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


def runtime_estimate() -> RuntimeEstimate:
    """The measured figures a new load's process estimate is made of (RuntimeEstimate.process_with)."""
    kind = process_kind()
    give_back_freed_memory()  # what the allocator keeps of freed memory is no part of the runtime
    now = resident_bytes()
    with _lock:
        held = _state["held"]
    if held is not None:
        return RuntimeEstimate(
            now, held, 0, "this process now, its last model's weights and KV pool replaced (measured)"
        )
    entry = _stored().get(kind, {})
    value = entry.get("first_load_overhead_bytes")
    if isinstance(value, int):
        source = f"this process now + what a first {kind} load added here ({entry.get('model')}, measured)"
        return RuntimeEstimate(now, None, value, source)
    return RuntimeEstimate(
        now, None, 0, "this process now (no load measured here yet: a first load adds to it)"
    )
