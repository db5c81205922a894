"""Which kernel runs how many rows: measured on this machine, not assumed.

For each weight format (and layer shape) every kernel is timed at row counts 1, 2, 4, ... 512
(best of a few calls, weights larger than the caches as in a real model), and the fastest one per
row count is kept in a table, cached on disk per CPU, torch version and thread count so a later
load reuses it. On the 2-core machine this was written on, the packed int4 kernel wins up to 256
rows and a bfloat16 dense matmul of the dequantized layer at 512; elsewhere the table says what
it says (the model's notes and `engine bench` print it).

A step's rows are not one block: each sequence's rows take the kernel chosen for *that
sequence*, never for the step's total: a decode row (and a speculative round's rows) the
one-row kernel, a prefill chunk the kernel for its whole prompt's length (not the chunk's, which
a prefix-cache hit shortens), and the LM head's logit rows the one-row kernel. Every kernel here
computes each row alone (packed paths at any row count, the bfloat16 dense path in fixed tiles of
64 rows, oneDNN float32 given two rows or more: tests/engine/test_batch_truth.py, test_kvk.py), so
a request's tokens do not depend on what else shares its step. The runner declares the step's rows with `KernelPolicy.step`; calls
outside a step (a reference forward through transformers' own code) choose by their total rows.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.cache_dirs import cache_root
from engine.kernels.gguf_weight import GGUFWeight, random_blocks
from engine.kernels.native import kernels as kvk_library
from engine.kernels.packing import quantize_int4_groups, quantize_int8_per_row
from engine.kernels.weights import DenseWeight, Int4GroupWeight, Int8RowWeight, Q8BlockWeight, WeightStorage
from engine.measure.memory import device_name
from engine.private import private_dir, write_private_text

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Timing: the best of several calls per kernel and row count, the kernels interleaved. The best
# of 7 is the least disturbed of them: on a busy machine most calls are slowed, but one of 7 is
# seldom slowed for both a kernel and its rival. The probe layer is replicated so its weights
# exceed the last-level cache, as a real model's layers do when they are streamed.
TIMING_REPEATS = 7
CALLS_PER_REPEAT = 4  # calls of each kernel per repeat, on rotating copies of the probe layer
PROBE_BYTES = 48 * 2**20
PROBE_SHAPE = (1024, 1024)
TABLE_VERSION = 7  # 6: per-call best of 7 x 4 for every kernel, a 25% margin confirmed at two row
# counts; 7: the margin is the storage's (GGUF: 100%, GGUFWeight.dense_margin)
# A dense kernel must beat the native one by the storage's margin (WeightStorage.dense_margin), at
# two row counts in a row (or at the last one), to take over.
SWITCH_MARGIN = WeightStorage.dense_margin
# A table is cached only when it was timed with the machine to itself: the process's CPU time over
# the timing's wall time and its threads (what its threads got of their cores) at least this
# share. Timed while another job took both cores of this 2-core machine (a test run), the share
# was 0.55-0.62, and one such table moved the packaged model's 512-row prefill to the bfloat16
# dense kernel, cached for good (quant-report: top-1 agreement 99.0% instead of 100%, mean KL
# 1.6e-4 instead of 3.3e-7); alone, 0.85-0.99 (ten timings of its two formats). Such a table
# serves its own process, and the next load measures again.
QUIET_CPU_SHARE = 0.75


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

    def add_uses(self, uses: dict[str, int], weight_bytes: int) -> None:
        """Many `add`s at once: counts by "kind/kernel" and their bytes (a fused forward's)."""
        for key, n in uses.items():
            self.uses[key] = self.uses.get(key, 0) + n
        self.weight_bytes += weight_bytes

    def summary(self) -> str:
        """'int4-g32/packed x120, q8_0/packed x1' (most used first)."""
        return ", ".join(f"{k} x{n}" for k, n in sorted(self.uses.items(), key=lambda kv: -kv[1]))


class KernelPolicy:
    """The kernel table of one loaded model, and the row plan of the step being run."""

    def __init__(self, table: dict[str, dict[int, str]] | None = None):
        self.table: dict[str, dict[int, str]] = table or {}  # storage key -> bucket -> kernel
        self._seq_rows: tuple[int, ...] | None = None
        self._kernel_rows: tuple[int, ...] = ()  # per sequence: the row count its kernel is chosen for
        self._packed_rows = 0  # sum(_seq_rows), read on every matmul of the step
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

    def kernels_at(self, rows: int, kinds: frozenset[str] | None = None) -> bytes:
        """The kernels rows chosen for `rows` run, one per format with a choice (of `kinds` only,
        when given), as bytes: two rows computed under equal values ran the same kernels, so their
        outputs (and the K/V a model writes from them) are the same bits. The prefix cache keys a
        block by it (engine/kv/manager.py): a block another kernel computed is not another
        prompt's."""
        key = bucket(rows)
        return ";".join(
            f"{name}={table[key]}"
            for name, table in sorted(self.table.items())
            if kinds is None or name in kinds
        ).encode()

    def describe(self) -> list[str]:
        """One line per measured format: which kernel runs which row counts, and how the table
        was made."""
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
        if lines:
            lines.append(
                f"table: best of {TIMING_REPEATS * CALLS_PER_REPEAT} interleaved timings per kernel and row count; a dense "
                f"kernel takes over only {SWITCH_MARGIN:.0%} faster at two row counts in a row (a GGUF "
                f"format's {GGUFWeight.dense_margin:.0%}: it rounds to bfloat16 what kvk keeps); a prefill "
                "takes the kernel for its prompt's length, a decode row the one-row kernel"
            )
        busy = {key: share for key, share in BUSY_TABLES.items() if key in self.table}
        if busy:
            shares = ", ".join(f"{key} {share:.0%}" for key, share in sorted(busy.items()))
            lines.append(
                f"table timed on a busy machine (its threads got {shares} of their cores): used for this "
                "run only, timed again at the next load"
            )
        return lines

    # ---- the step --------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, seq_rows: Sequence[int], kernel_rows: Sequence[int] | None = None) -> Iterator[StepRecord]:
        """Run a forward whose packed rows are, in order, runs of `seq_rows[i]` rows (a sequence's
        rows, or those on one side of its prompt's end), run i's kernels chosen for
        `kernel_rows[i]` rows (default: its own rows)."""
        self._seq_rows, self._plans, self.record = tuple(seq_rows), {}, StepRecord()
        self._kernel_rows = tuple(kernel_rows) if kernel_rows is not None else self._seq_rows
        self._packed_rows = sum(self._seq_rows)
        try:
            yield self.record
        finally:
            self._seq_rows, self._plans, self._kernel_rows = None, {}, ()

    def plan(self, storage: WeightStorage, rows: int) -> list[tuple[int, int, str]]:
        """[(start, stop, kernel)] segments covering `rows` packed rows."""
        seq_rows = self._seq_rows
        if seq_rows is None:
            return [(0, rows, self.choose(storage, rows))]
        if rows != self._packed_rows:
            # Inside a step, rows that are not the packed rows are the logit rows (the LM head):
            # each takes the one-row kernel, whatever number of sequences samples beside it.
            return [(0, rows, self.choose(storage, 1))]
        key = table_key(storage)
        plan = self._plans.get(key)
        if plan is None:
            plan, start = [], 0
            for n, k in zip(seq_rows, self._kernel_rows):
                kernel = self.choose(storage, k)
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
BUSY_TABLES: dict[str, float] = {}  # formats timed on a busy machine this process: their CPU share


def measure(storage: WeightStorage, cpu_clock: Callable[[], float] = time.process_time) -> dict[int, str]:
    """Fastest kernel per row bucket for a storage of this format and shape (cached on disk when
    timed on a quiet machine). `cpu_clock`: a test's fake CPU time."""
    key = table_key(storage)
    if key in _MEASURED:
        return _MEASURED[key]
    cached = _load_cached().get(key)
    if cached is None:
        cpu, wall = cpu_clock(), time.perf_counter()
        cached = _time_kernels(storage)
        threads = min(torch.get_num_threads(), _usable_cores())
        share = (cpu_clock() - cpu) / max(1e-9, (time.perf_counter() - wall) * threads)
        if share >= QUIET_CPU_SHARE:
            _save_cached(key, cached)
        else:
            BUSY_TABLES[key] = share
    _MEASURED[key] = cached
    return cached


def _usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _probe_copies(storage: WeightStorage) -> list[WeightStorage]:
    """A probe layer of PROBE_SHAPE in the storage's format, and enough copies of it (separate
    memory, same values) that streaming through them spills the caches as a model's layers do."""

    n, k = PROBE_SHAPE
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    probe: WeightStorage
    if isinstance(storage, GGUFWeight):
        probe = GGUFWeight(storage.ggml_type, random_blocks(storage.ggml_type, n, k), k, lib=storage.lib)
        if storage.can_use_panels():  # timed as the layers run (repacked after the table: its
            probe.use_panels()  # probes are freed before the model's panels take their memory)
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


def _time_kernels(
    storage: WeightStorage,
    clock: Callable[[], float] = time.perf_counter,
    probes: list[WeightStorage] | None = None,
) -> dict[int, str]:
    """Best-of-N times per kernel and row count, the kernels interleaved round by round so a
    burst of load elsewhere on the machine slows all of them, not one. Row counts go up until a
    dense kernel has won twice in a row (the crossover found and confirmed); the larger ones
    take the winner without being timed (the packaged model's two formats, int4-g32 and q8_0,
    measured in 1.7 s and 0.7 s on 2 cores with 3 repeats; about twice that with 7). `clock`
    and `probes`: a test's fake timer and layers (tests/engine/test_kernel_table.py)."""
    probes = probes if probes is not None else _probe_copies(storage)
    kernels = storage.kernels()
    native = storage.native_kernel
    margin = getattr(storage, "dense_margin", SWITCH_MARGIN)
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
            for repeat in range(TIMING_REPEATS):
                # each kernel over the same few copies, each call timed alone and the best kept:
                # a call slowed by load elsewhere is dropped, both kernels get as many chances
                # (a sum over the copies would keep every copy's slowdown, and more calls of one
                # kernel would give it more chances), and the copies rotate so every call reads
                # its weights out of cache, as a model's layers do
                batch = [
                    probes[(repeat * CALLS_PER_REPEAT + j) % len(probes)] for j in range(CALLS_PER_REPEAT)
                ]
                for kernel in kernels:
                    for probe in batch:
                        start = clock()
                        probe.matmul(kernel, x)
                        best[kernel] = min(best[kernel], clock() - start)
            times[rows] = best
            wins = wins + 1 if _dense_wins(best, native, margin) else 0
    return choose_by_rows(times, native, margin)


def _dense_wins(by_kernel: dict[str, float], native: str, margin: float = SWITCH_MARGIN) -> bool:
    dense = [t for k, t in by_kernel.items() if k != native]
    return native in by_kernel and bool(dense) and min(dense) * (1 + margin) < by_kernel[native]


def choose_by_rows(
    times: dict[int, dict[str, float]], native: str, margin: float = SWITCH_MARGIN
) -> dict[int, str]:
    """One crossover, measured and confirmed: the storage's own kernel (the packed one, which
    reads the fewest bytes) up to the first row count where a dense kernel is faster by
    `margin` there and at the next row count too (or at the last one measured), the
    fastest dense kernel from there on. A dense matmul only gains on a GEMV-shaped kernel as
    rows grow, so a table that flips back and forth is timing noise; one confirmed switch point
    keeps the choice the same between runs and between a busy machine and a quiet one."""
    order = sorted(times)
    best: dict[int, str] = {}
    switched = False
    for i, rows in enumerate(order):
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
        if not switched and _dense_wins(by_kernel, native, margin):
            following = order[i + 1] if i + 1 < len(order) else None
            switched = following is None or _dense_wins(times[following], native, margin)
        best[rows] = min(dense, key=dense.__getitem__) if switched else native
    return best


def _cache_file() -> Path:
    """Per CPU, torch version, thread count and kvk build (its source's hash): a table measured
    for other kernels would pick crossovers they no longer have."""
    cpu = device_name(torch.device("cpu"))
    lib = kvk_library()
    kvk = lib.path.stem if lib is not None else "nokvk"
    name = f"kernels-{platform.machine()}-torch{torch.__version__}-t{torch.get_num_threads()}-{kvk}-{cpu}"
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
        private_dir(path.parent)
        write_private_text(path, json.dumps({"version": TABLE_VERSION, "tables": tables}, indent=1))
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
