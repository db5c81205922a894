"""A GGUF tensor kept as the file stores it: its blocks, memory-mapped, multiplied by kvk.

Two kernels, chosen per row count by the kernel table (engine/kernels/policy.py):
  "kvk"         the C kernel on the blocks themselves, activations rounded to 16-bit codes (one
                scale per 256 inputs); every row computed alone, so a sequence's rows never
                depend on the rows beside them, and a prompt's rows get the bits a decode row gets.
  "dense-bf16"  the layer decoded to bfloat16 into a reused buffer, then oneDNN's bfloat16 GEMM
                with bfloat16 activations: faster for long prefill chunks (the weights are read
                once per chunk; the GEMM reuses them across rows), never for a decode row. It
                multiplies by the file's weights rounded to bfloat16, not by the weights.
`exact_matmul` (the LM head) multiplies every weight, decoded to float32 as gguf decodes it, by
float32 activations: every logit comes from the file's weights with no activation rounding.

`blocks` is a view of the file's mapping, so the process holds the file's pages (shared with the
page cache), not a second copy of the weights. One exception, where it pays: a linear layer's
Q4_0, Q4_1, Q4_K and Q6_K rows on a CPU with AVX-512 VNNI are repacked once at load into panels of
16 rows side by side (`use_panels`, engine/kernels/native/panels.c: the file's bytes in another
order, Q4_K's 6-bit scales unpacked to bytes, +2.8%; kvk's matmuls 1.0-2.3x faster at 1.7B
shapes), and the file's pages they came from are handed back, so the process still holds the
tensor once. A row permutation (llama.cpp stores Llama's q/k rows interleaved for its RoPE) is
applied by the kernel (or by the repacking), not to the file's data.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.kernels import native
from engine.kernels.weights import WeightStorage

# The types kvk keeps at their own bits: the tensors of Q4_K_M, Q5_K_M, Q6_K, Q8_0 and IQ4_XS
# files and the older 32-weight formats.
KVK_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
    )
)


class GGUFWeight(WeightStorage):
    def __init__(
        self,
        ggml_type: GGMLQuantizationType,
        blocks: np.ndarray,
        in_features: int,
        row_map: np.ndarray | None = None,
        lib: native.Kvk | None = None,
    ):
        """`blocks`: uint8 [rows, bytes per row], a view of the file; `row_map`: the stored row
        each output row reads (None: in order)."""
        kvk = lib or native.kernels()
        if kvk is None:
            raise RuntimeError(f"GGUF {ggml_type.name} weights need the kvk kernels: {native.status()}")
        block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
        if in_features % block_weights or blocks.shape[1] != in_features // block_weights * block_bytes:
            raise ValueError(
                f"a {ggml_type.name} row of {in_features} weights is {in_features // block_weights * block_bytes} "
                f"bytes, the tensor has {blocks.shape[1]}"
            )
        self.lib = kvk
        self.ggml_type = ggml_type
        # the tensors whose rows the table points into (kept alive here)
        self.parts: tuple[np.ndarray, ...] = (blocks,)
        self.row_table = native.row_addresses(blocks, row_map)  # output row -> its weights' address
        self.in_features = in_features
        self.out_features = self.row_table.shape[0]
        self.kind = ggml_type.name.lower()
        self.native_kernel = "kvk"
        self.panels: np.ndarray | None = None  # the rows repacked (use_panels), what "kvk" multiplies
        self._bind()

    def file_bytes(self) -> int:
        """The bytes of the file's rows this storage multiplies (its row table's rows)."""
        block_weights, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return self.out_features * (self.in_features // block_weights) * block_bytes

    def can_use_panels(self) -> bool:
        """Whether this build multiplies panels of this type and shape (use_panels would repack)."""
        return (
            int(self.lib.lib.kvk_panel_bytes(int(self.ggml_type), self.out_features, self.in_features)) >= 0
        )

    def use_panels(self, release_file_pages: bool = False) -> bool:
        """Repack the rows into panels where this build multiplies panels of this type (Q4_0,
        Q4_1, Q4_K, Q6_K; AVX-512 VNNI); from then on the "kvk" kernel multiplies the panels.
        `release_file_pages`: hand back the pages of the file mapping the rows are a view of
        (read again from the file if a row path ever needs them: an exact product, the dense
        kernel, a probe's copy); anonymous memory is left alone. Returns whether it repacked."""
        if not self.can_use_panels():
            return False
        panels = self.lib.repack_panels(self.ggml_type, self.row_table, self.in_features)
        assert panels is not None
        self.panels = panels
        self.__dict__.pop("nbytes", None)  # what it holds is now the panels
        if release_file_pages:
            for part in self.parts:
                if file_mapped(part):
                    release_pages(part)
        self._bind()
        return True

    # The dense kernel takes over only where it is twice as fast as kvk (the kernel table): it
    # rounds to bfloat16 the activations kvk keeps in 16-bit codes, and the weights (the packaged
    # model against its float32 twin: top-1 99.0% where kvk gives 100%), and a prefix-cache block
    # it computed serves no prompt whose rows ran kvk (engine/kv/manager.py), so a chat's
    # follow-up recomputes the reply before it. On this 2-core EPYC it is 1.2-1.9x faster at
    # 64-512 rows (kvk 200-300 GFLOP/s, oneDNN's bfloat16 GEMM 300-360): kvk runs every row here;
    # where kvk has no vector path (a CPU without AVX-512 VNNI) the dense kernel still takes over.
    dense_margin = 1.0

    def _bind(self) -> None:
        """What a decode-row call passes to C, read once: a call then costs the ctypes crossing,
        not the table's address lookup (numpy's .ctypes is ~1 us) and argument checks (~4 us
        a call, 120+ calls a token)."""
        native.check_table(self.row_table)
        # a permuted table (Llama's q/k rows as transformers orders them, a fused q|k|v) is read
        # in address order by a decode row: the outputs stay where the table puts them
        self.visit = native.visit_order(self.row_table)
        self._call_kvk: Callable[..., int]
        self._args: tuple[int, ...]
        if self.panels is not None:  # the panels hold the rows in output order: nothing to visit
            self._call_kvk = self.lib.lib.kvk_matmul_panels
            self._args = (int(self.ggml_type), self.panels.ctypes.data, self.out_features, self.in_features)
        else:
            self._call_kvk = self.lib.lib.kvk_matmul_visit
            visit = 0 if self.visit is None else self.visit.ctypes.data
            self._args = (
                int(self.ggml_type),
                self.row_table.ctypes.data,
                visit,
                self.out_features,
                self.in_features,
            )

    @classmethod
    def cat(cls, parts: list[GGUFWeight]) -> GGUFWeight:
        """One storage over several tensors of one type and width, their output rows one after
        another (a fused q/k/v or gate/up: one kernel call), each still where the file has it."""
        first = parts[0]
        fused = object.__new__(cls)
        fused.lib, fused.ggml_type, fused.kind = first.lib, first.ggml_type, first.kind
        fused.parts = tuple(b for p in parts for b in p.parts)
        fused.row_table = np.concatenate([p.row_table for p in parts])
        fused.in_features, fused.out_features = first.in_features, int(fused.row_table.shape[0])
        fused.native_kernel = "kvk"
        fused.panels = None  # fusion comes before repacking (engine.kernels.linear.repack_for_kernels)
        fused._bind()
        return fused

    def __deepcopy__(self, memo: dict[int, object]) -> GGUFWeight:
        """A copy with its own blocks in memory (the kernel table's probes); the library is shared."""
        copy = GGUFWeight(self.ggml_type, self.dequantizable_copy(), self.in_features, lib=self.lib)
        if self.panels is not None:
            copy.use_panels()
        return copy

    def dequantizable_copy(self) -> np.ndarray:
        """The rows' blocks copied in output order into one array [rows, bytes per row]."""
        row_bytes = self.parts[0].shape[1]
        out = np.empty((self.out_features, row_bytes), dtype=np.uint8)
        for part in self.parts:
            base = part.ctypes.data
            span = part.shape[0] * part.strides[0]
            inside = (self.row_table >= base) & (self.row_table < base + span)
            rows = ((self.row_table[inside] - np.uint64(base)) // np.uint64(part.strides[0])).astype(np.int64)
            out[inside] = part[rows]
        return out

    def kernels(self) -> tuple[str, ...]:
        return ("kvk", "dense-bf16")

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        if kernel == "kvk":
            y = self._kvk(flat)
        else:
            y = self._dense_bf16(flat)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _kvk(self, flat: torch.Tensor) -> torch.Tensor:
        """kvk's matmul on float32 rows [R, in_features] (contiguous: matmul made them so)."""
        if flat.dim() != 2 or flat.shape[1] != self.in_features:
            raise ValueError(f"activations must be [rows, {self.in_features}], got {tuple(flat.shape)}")
        rows = flat.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        k, n = self.in_features, self.out_features
        status = self._call_kvk(*self._args, flat.data_ptr(), k, rows, out.data_ptr(), n)
        if status != 0:
            raise RuntimeError(
                f"kvk_matmul refused GGML type {self.ggml_type.name} with {k} inputs (status {status})"
            )
        return out

    def _dense_bf16(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense kernel a slice of output rows at a time: each slice decoded into one small
        reused buffer, then the GEMM. A whole layer's bfloat16 copy (64 MiB for a 1.7B model's
        gate|up) would be held by the process for its life; a slice of DENSE_SLICE_WEIGHTS keeps
        the buffer in cache between decoding and GEMM and changes no output: each output is
        still one dot product over all its inputs.

        The GEMM always multiplies exactly DENSE_ROW_TILE rows (the last tile padded with copies
        of its last row): oneDNN picks its code path by the row count, and paths round
        differently (measured: a lone row's GEMV gave 10 of 97 rows of a 1536 -> 576 layer other
        bits; without AVX512-BF16, 2-3 rows and 8-32 rows each differed from 97), so a prompt's
        last row alone (a prefix-cache hit, a one-row last chunk) would not get the bits it gets
        in its prompt. At one shape a row's bits are its own wherever it sits in the tile
        (measured at every oneDNN ISA this CPU offers: tests/engine/test_kvk.py)."""
        rows_per_slice = max(1, DENSE_SLICE_WEIGHTS // self.in_features)
        rows = flat.shape[0]
        if rows == 0:
            return torch.empty(0, self.out_features)
        tiles = -(-rows // DENSE_ROW_TILE)
        activations = torch.empty(tiles * DENSE_ROW_TILE, self.in_features, dtype=torch.bfloat16)
        activations[:rows] = flat
        activations[rows:] = activations[rows - 1 : rows]
        y = torch.empty(activations.shape[0], self.out_features, dtype=torch.float32)
        for start in range(0, self.out_features, rows_per_slice):
            table = self.row_table[start : start + rows_per_slice]
            weight = self.lib.dequantize_bf16(
                self.ggml_type, table, self.in_features, _bf16_scratch(table.shape[0], self.in_features)
            )
            for tile in range(0, activations.shape[0], DENSE_ROW_TILE):
                y[tile : tile + DENSE_ROW_TILE, start : start + table.shape[0]] = F.linear(
                    activations[tile : tile + DENSE_ROW_TILE], weight
                )
        return y[:rows]

    def exact_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 activations times every weight decoded to float32 (the exact LM head)."""
        flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = self.lib.matmul(self.ggml_type, self.row_table, self.in_features, flat, exact=True)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized exactly as gguf does (an embedding lookup): [len(ids), in]."""
        return self.lib.dequantize_rows(self.ggml_type, self.row_table, self.in_features, ids.reshape(-1)).to(
            dtype
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features), dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        if self.panels is not None:  # the file's pages were handed back, or are not multiplied
            return (torch.from_numpy(self.panels),)
        return tuple(torch.from_numpy(part) for part in self.parts)

    def bytes_read(self, kernel: str) -> int:
        if kernel in ("kvk", "exact"):
            return self.nbytes
        return self.nbytes + 2 * 2 * self.out_features * self.in_features  # the bf16 copy written, read


def file_mapped(view: np.ndarray) -> bool:
    """Whether `view` is (a view of) a memory-mapped file: the only memory release_pages may
    hand back."""
    base: object = view
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def release_pages(view: np.ndarray) -> None:
    """Hand back the whole pages under `view`, a view of a read-only or copy-on-write file mapping
    (never anonymous memory: MADV_DONTNEED would zero it): the process stops holding them and a
    later read faults them in from the file again."""
    if not hasattr(mmap, "MADV_DONTNEED") or view.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = -(-view.ctypes.data // page) * page  # whole pages inside the view only
    stop = (view.ctypes.data + view.nbytes) // page * page
    if stop > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


# One bfloat16 buffer for the dense kernel's slices, reused across calls and layers (a fresh
# buffer a call costs its page faults: measured 10x the decoding itself for a whole layer's copy).
_SCRATCH = threading.local()
DENSE_SLICE_WEIGHTS = 1 << 22  # 8 MiB of bfloat16
# Rows per GEMM call of the dense kernel: a long prompt's GEMMs lose ~16% against one call of 512
# rows (2048 x 2048, this 2-core EPYC), and a lone row costs a 64-row GEMM; the kernel table
# measures the dense kernel this way, so it is chosen only where it still wins.
DENSE_ROW_TILE = 64


def _bf16_scratch(rows: int, cols: int) -> torch.Tensor:
    size = rows * cols
    buf: torch.Tensor | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH.buf = torch.empty(size, dtype=torch.bfloat16)
    return buf[:size].view(rows, cols)


def random_blocks(
    ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int = 0, magnitude: float = 0.05
) -> np.ndarray:
    """Valid blocks of `ggml_type` with random codes, [rows, bytes per row], whose weights are of
    the order of `magnitude`: any bytes are valid codes, only the float16 scale fields are set
    (kernel probes and tests; random weights in the shapes people download)."""
    rng = np.random.default_rng(seed)
    if ggml_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        w = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
        if ggml_type == GGMLQuantizationType.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    per_row = cols // block_weights
    raw = rng.integers(0, 256, size=(rows, per_row, block_bytes), dtype=np.uint8)
    for offset, divisor in SCALE_FIELDS[ggml_type]:
        scale = magnitude / divisor * rng.uniform(0.5, 1.5, size=(rows, per_row))
        raw[..., offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, per_row, 2)
    return raw.reshape(rows, per_row * block_bytes)


# Per type, each block's float16 scale fields: (byte offset, how many times the field the largest
# code times sub-scale reaches), so that random codes make weights of a given magnitude.
SCALE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, float], ...]] = {
    GGMLQuantizationType[name]: fields
    for name, fields in (
        ("Q4_0", ((0, 8.0),)),
        ("Q4_1", ((0, 15.0), (2, -2.0))),
        ("Q5_0", ((0, 16.0),)),
        ("Q5_1", ((0, 31.0), (2, -2.0))),
        ("Q8_0", ((0, 127.0),)),
        ("IQ4_NL", ((0, 127.0),)),
        ("Q2_K", ((80, 45.0), (82, 30.0))),
        ("Q3_K", ((108, 128.0),)),
        ("Q4_K", ((0, 945.0), (2, 126.0))),
        ("Q5_K", ((0, 1953.0), (2, 126.0))),
        ("Q6_K", ((208, 4064.0),)),
        ("IQ4_XS", ((0, 4064.0),)),
    )
}
