"""Which kernel runs how many rows: measured on this machine, not assumed.

For each weight format (and layer shape) every kernel is timed at row counts 1, 2, 4, ... 512
(best of a few calls, weights larger than the caches as in a real model), and the fastest one per
row count is kept in a table, cached on disk per CPU, torch version and thread count so a later
load reuses it. On the 2-core machine this was written on, the packed int4 kernel wins up to 256
rows and a bfloat16 dense matmul of the dequantized layer at 512; elsewhere the table says what
it says (the model's notes and `engine bench` print it).

A step's rows are not one block: each sequence's rows take the kernel for *its own* row count
(a decode row always the decode kernel, a prefill chunk the prefill kernel), so a request's tokens
do not depend on what else shares its step (batched decoding equals lone decoding). The runner
declares the step's per-sequence row counts with `KernelPolicy.step`; calls outside a step (a
reference forward through transformers' own code) choose by their total rows.
"""

from __future__ import annotations

import contextlib
import copy
import json
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.cache_dirs import cache_root
from engine.kernels.gguf_weight import GGUFWeight, random_blocks
from engine.kernels.packing import quantize_int4_groups, quantize_int8_per_row
from engine.kernels.weights import DenseWeight, Int4GroupWeight, Int8RowWeight, Q8BlockWeight, WeightStorage
from engine.measure.memory import device_name

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Timing: the best of a few calls per kernel and row count. The probe layer is replicated so its
# weights exceed the last-level cache, as a real model's layers do when they are streamed.
TIMING_REPEATS = 3
PROBE_BYTES = 48 * 2**20
PROBE_SHAPE = (1024, 1024)
TABLE_VERSION = 4
# A dense kernel must beat the native one by this much to take over (timing noise is ~5%).
SWITCH_MARGIN = 0.10


def bucket(rows: int) -> int:
    """The measured row count that stands for `rows` (the next one up, capped at the largest)."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return ROW_BUCKETS[-1]


@dataclass(slots=True)
class StepRecord:
    """What the linears of one forward ran: kernel uses by name, and the weight bytes they read."""

    uses: dict[str, int] = field(default_factory=dict)  # "int4-g32/packed" -> calls
    weight_bytes: int = 0

    def add(self, storage: WeightStorage, kernel: str) -> None:
        key = f"{storage.kind}/{kernel}"
        self.uses[key] = self.uses.get(key, 0) + 1
        self.weight_bytes += storage.bytes_read(kernel)

    def summary(self) -> str:
        """'int4-g32/packed x120, q8_0/packed x1' (most used first)."""
        return ", ".join(f"{k} x{n}" for k, n in sorted(self.uses.items(), key=lambda kv: -kv[1]))


class KernelPolicy:
    """The kernel table of one loaded model, and the row plan of the step being run."""

    def __init__(self, table: dict[str, dict[int, str]] | None = None):
        self.table: dict[str, dict[int, str]] = table or {}  # storage key -> bucket -> kernel
        self._seq_rows: tuple[int, ...] | None = None
        self._plans: dict[str, list[tuple[int, int, str]]] = {}
        self.record = StepRecord()

    # ---- the table -------------------------------------------------------------------------
    def choose(self, storage: WeightStorage, rows: int) -> str:
        kernels = storage.kernels()
        if len(kernels) == 1:
            return kernels[0]
        by_bucket = self.table.get(table_key(storage))
        if by_bucket is None:
            by_bucket = self.table[table_key(storage)] = measure(storage)
        return by_bucket[bucket(rows)]

    def prepare(self, storages: list[WeightStorage]) -> None:
        """Measure (or read from the cache) the table of every format and shape in a model now,
        at load, so the first forward is not slowed by it and the load can say what runs."""
        for storage in storages:
            if len(storage.kernels()) > 1 and table_key(storage) not in self.table:
                self.table[table_key(storage)] = measure(storage)

    def describe(self) -> list[str]:
        """One line per measured format: which kernel runs which row counts."""
        lines = []
        for key, by_bucket in sorted(self.table.items()):
            spans: list[tuple[int, int, str]] = []
            for b in ROW_BUCKETS:
                if spans and spans[-1][2] == by_bucket[b]:
                    spans[-1] = (spans[-1][0], b, by_bucket[b])
                else:
                    spans.append((b, b, by_bucket[b]))
            text = "; ".join(
                f"{lo}-{hi} rows: {k}" if lo != hi else f"{lo} row{'s' * (lo > 1)}: {k}"
                for lo, hi, k in spans
            )
            lines.append(f"{key}: {text}")
        return lines

    # ---- the step --------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, seq_rows: Sequence[int]) -> Iterator[StepRecord]:
        """Run a forward whose packed rows are, in order, `seq_rows[i]` rows per sequence."""
        self._seq_rows, self._plans, self.record = tuple(seq_rows), {}, StepRecord()
        try:
            yield self.record
        finally:
            self._seq_rows, self._plans = None, {}

    def plan(self, storage: WeightStorage, rows: int) -> list[tuple[int, int, str]]:
        """[(start, stop, kernel)] segments covering `rows` packed rows."""
        seq_rows = self._seq_rows
        if seq_rows is None or sum(seq_rows) != rows:
            return [(0, rows, self.choose(storage, rows))]
        key = table_key(storage)
        plan = self._plans.get(key)
        if plan is None:
            plan, start = [], 0
            for n in seq_rows:
                kernel = self.choose(storage, n)
                if plan and plan[-1][2] == kernel:
                    plan[-1] = (plan[-1][0], start + n, kernel)
                else:
                    plan.append((start, start + n, kernel))
                start += n
            self._plans[key] = plan
        return plan


# ---- measuring -------------------------------------------------------------------------------
def table_key(storage: WeightStorage) -> str:
    """One table per weight format: the packed and the dense costs both grow with the layer's
    size, so where one overtakes the other is a row count of the format, not of the shape."""
    return storage.kind


_MEASURED: dict[str, dict[int, str]] = {}  # per process: one measurement per format and shape


def measure(storage: WeightStorage) -> dict[int, str]:
    """Fastest kernel per row bucket for a storage of this format and shape (cached on disk)."""
    key = table_key(storage)
    if key in _MEASURED:
        return _MEASURED[key]
    cached = _load_cached().get(key)
    if cached is None:
        cached = _time_kernels(storage)
        _save_cached(key, cached)
    _MEASURED[key] = cached
    return cached


def _probe_copies(storage: WeightStorage) -> list[WeightStorage]:
    """A probe layer of PROBE_SHAPE in the storage's format, and enough copies of it (separate
    memory, same values) that streaming through them spills the caches as a model's layers do."""

    n, k = PROBE_SHAPE
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    probe: WeightStorage
    if isinstance(storage, GGUFWeight):
        probe = GGUFWeight(storage.ggml_type, random_blocks(storage.ggml_type, n, k), k, lib=storage.lib)
    elif isinstance(storage, Int4GroupWeight):
        probe = Int4GroupWeight(*quantize_int4_groups(w, 32))
    elif isinstance(storage, Int8RowWeight):
        probe = Int8RowWeight(*quantize_int8_per_row(w))
    elif isinstance(storage, Q8BlockWeight):
        scales = (w.reshape(n, k // 32, 32).abs().amax(-1) / 127).clamp(min=1e-8)
        codes = torch.round(w.reshape(n, k // 32, 32) / scales[..., None]).clamp(-127, 127)
        probe = Q8BlockWeight(codes.reshape(n, k).to(torch.int8), scales.half())
    else:
        assert isinstance(storage, DenseWeight)
        probe = DenseWeight(w.to(storage.dtype))
    count = max(1, min(64, PROBE_BYTES // max(1, probe.nbytes)))
    copies: list[WeightStorage] = [probe]
    return copies + [copy.deepcopy(probe) for _ in range(count - 1)]


def _time_kernels(storage: WeightStorage) -> dict[int, str]:
    """Best-of-N times per kernel and row count, the kernels interleaved round by round so a
    burst of load elsewhere on the machine slows all of them, not one. Row counts go up until a
    dense kernel has won twice in a row (the crossover found and confirmed); the larger ones
    take the winner without being timed (the packaged model's two formats, int4-g32 and q8_0, measure
    in 1.7 s and 0.7 s on 2 cores)."""
    probes = _probe_copies(storage)
    kernels = storage.kernels()
    native = storage.native_kernel
    times: dict[int, dict[str, float]] = {}
    wins = 0
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            if wins >= 2:
                times[rows] = times[max(times)]  # past the confirmed crossover: the same winner
                continue
            x = torch.randn(rows, probes[0].in_features)
            for kernel in kernels:
                probes[0].matmul(kernel, x)  # warm up
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(TIMING_REPEATS):
                for kernel in kernels:
                    # the packed kernel streams its weights (the copies keep them out of cache);
                    # a dense path's cost is dequantizing and multiplying: one copy tells it
                    copies = probes if kernel == native else probes[:1]
                    start = time.perf_counter()
                    for probe in copies:
                        probe.matmul(kernel, x)
                    best[kernel] = min(best[kernel], (time.perf_counter() - start) / len(copies))
            times[rows] = best
            dense = min((t for k, t in best.items() if k != native), default=float("inf"))
            wins = wins + 1 if native in best and dense * (1 + SWITCH_MARGIN) < best[native] else 0
    return choose_by_rows(times, native)


def choose_by_rows(times: dict[int, dict[str, float]], native: str) -> dict[int, str]:
    """One crossover, measured: the storage's own kernel (the packed one, which reads the fewest
    bytes) up to the first row count where a dense kernel is faster by SWITCH_MARGIN, the fastest
    dense kernel from there on. A dense matmul only gains on a GEMV-shaped kernel as rows grow, so
    a table that flips back and forth is timing noise; one switch point keeps the choice stable
    between runs and machines' loads."""
    best: dict[int, str] = {}
    switched = False
    for rows in sorted(times):
        by_kernel = times[rows]
        dense = {k: t for k, t in by_kernel.items() if k != native}
        if native not in by_kernel or not dense:
            best[rows] = min(by_kernel, key=by_kernel.__getitem__)
            continue
        if rows == 1:
            # One row: a dense path reads the stored weights too, then writes and reads a dense
            # copy of them; it cannot be faster, and a time saying so was interrupted.
            best[rows] = native
            continue
        fastest_dense = min(dense, key=dense.__getitem__)
        switched = switched or dense[fastest_dense] * (1 + SWITCH_MARGIN) < by_kernel[native]
        best[rows] = fastest_dense if switched else native
    return best


def _cache_file() -> Path:
    cpu = device_name(torch.device("cpu"))
    name = f"kernels-{platform.machine()}-torch{torch.__version__}-t{torch.get_num_threads()}-{cpu}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cache_root() / "kernels" / f"{safe}.json"


def _load_cached() -> dict[str, dict[int, str]]:
    try:
        raw = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    if raw.get("version") != TABLE_VERSION:
        return {}
    return {k: {int(b): v for b, v in t.items()} for k, t in raw.get("tables", {}).items()}


def _save_cached(key: str, table: dict[int, str]) -> None:
    path = _cache_file()
    tables = _load_cached()
    tables[key] = table
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": TABLE_VERSION, "tables": tables}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
