"""FlashAttention's lesson, measured on this machine: SDPA's math kernel materialises the N x N
score matrix of every head, the flash kernel never does (it streams keys in tiles with an online
softmax), so long prefills run faster and in a fraction of the memory.

The engine's own prefill runs under each SDPA backend in turn (torch.nn.attention.sdpa_kernel),
prompt lengths growing, interleaved: its time, and the process's peak memory above what it held
before (Linux's VmHWM, reset through /proc/self/clear_refs before each run), beside the bytes of
the score matrix only the math kernel allocates (heads x N x N float32 per layer call).
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.bench.sweep import _Bench, _check_lengths, prompt_ids
from engine.config import ConfigError

if TYPE_CHECKING:
    from torch.nn.attention import SDPBackend

    from engine.bench.sweep import Progress, _Bench
    from engine.model.loaded import LoadedModel

KERNELS = ("math", "flash")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _backend(kernel: str) -> SDPBackend:
    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[kernel]


def _status_bytes(field: str) -> int | None:
    try:
        match = re.search(rf"{field}:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_peak() -> bool:
    """Linux >= 4.0: writing 5 resets the peak RSS to the current RSS."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def measure_prefill(bench: _Bench, prompt: list[int], kernel: str) -> tuple[float, int | None]:
    """(seconds, peak bytes above the start) of one prefill of `prompt` under `kernel`."""

    with sdpa_kernel([_backend(kernel)]):
        peak_known = _reset_peak()
        base = _status_bytes("VmRSS")
        start = time.perf_counter()
        bench.run(prompt, 1)
        seconds = time.perf_counter() - start
        peak = _status_bytes("VmHWM")
    if not peak_known or base is None or peak is None:
        return seconds, None
    return seconds, max(0, peak - base)


def compare_attention_kernels(
    loaded: LoadedModel, lengths: list[int], repeats: int = 2, progress: Progress | None = None
) -> dict[str, Any]:
    """Rows per (prompt length, kernel): median prefill time, largest peak memory, score bytes."""

    report = progress or (lambda message: None)
    lengths = _check_lengths(list(lengths), "prompt length")
    if repeats < 1:
        raise ConfigError("repeats must be at least 1")
    bench = _Bench(loaded, max(lengths) + 2)
    bench.warm_up()
    heads = loaded.info.num_heads
    samples: dict[tuple[int, str], list[tuple[float, int | None]]] = {}
    for n in lengths:
        prompt = prompt_ids(loaded.tokenizer, n)
        for r in range(repeats):
            for kernel in KERNELS if r % 2 == 0 else KERNELS[::-1]:  # alternate: drift hits both
                report(f"{kernel}: {n} tokens, run {r + 1}/{repeats}")
                samples.setdefault((n, kernel), []).append(measure_prefill(bench, prompt, kernel))
    rows: list[dict[str, Any]] = []
    for (n, kernel), runs in samples.items():
        peaks = [p for _, p in runs if p is not None]
        rows.append(
            {
                "prompt_tokens": n,
                "kernel": kernel,
                "prefill_s": statistics.median(s for s, _ in runs),
                "peak_bytes": max(peaks) if peaks else None,
                "score_matrix_bytes": heads * n * n * 4 if kernel == "math" else 0,
            }
        )
    by = {(r["prompt_tokens"], r["kernel"]): r for r in rows}
    for n in lengths:
        by[(n, "math")]["time_vs_flash"] = by[(n, "math")]["prefill_s"] / by[(n, "flash")]["prefill_s"]
    return {
        "model": loaded.info.name,
        "heads": heads,
        "layers": loaded.info.num_layers,
        "peak_memory_source": "VmHWM after /proc/self/clear_refs" if _CLEAR_REFS.exists() else None,
        "rows": sorted(rows, key=lambda r: (r["prompt_tokens"], r["kernel"])),
    }
