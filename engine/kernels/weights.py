"""A linear layer's weights in their own format, and the kernels that can multiply by them.

Each storage offers a few kernels, by name:
  "dense-fp32"   dequantize (or upcast) the whole layer to float32, then F.linear
  "dense-bf16"   dequantize to bfloat16, then F.linear in bfloat16
  "packed"       torch's packed weight-only kernel on the codes themselves, with bfloat16
                 activations (the only activations its vectorised CPU code takes)
The kernel policy (engine.kernels.policy) measures them on this machine and picks one per row
count: packed kernels win for decode-sized rows (they read 4-8x fewer bytes), dense matmuls for
prefill-sized rows (a GEMV-shaped kernel does not reuse the weights across rows).

Every kernel of a storage multiplies by the same numbers: the dense paths dequantize exactly what
the packed kernel reads (its bfloat16 scales included), so switching kernels changes rounding in
the accumulation only, never the weights. Dense float32 weights have one kernel: the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kernels import int4_layout
from engine.kernels.packing import quantize_int8_per_row

INT4_GROUP = 32
INT4_MID = 8  # torch's int4 kernels compute (code - 8) * scale + zero
PACKED_ACTIVATION_DTYPE = torch.bfloat16


class WeightStorage:
    """Weights [out_features, in_features] in some format."""

    kind = ""  # names the format in step stats and the kernel table
    out_features: int
    in_features: int

    def kernels(self) -> tuple[str, ...]:
        raise NotImplementedError

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype, through `kernel`."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights every kernel multiplies by, as a dense [out, in] tensor."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the storage holds (the model's weight-byte count walks them)."""
        raise NotImplementedError

    @functools.cached_property
    def nbytes(self) -> int:
        """The stored bytes (fixed once built; read on every matmul for the step's byte count)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_read(self, kernel: str) -> int:
        """Bytes of weights one call of `kernel` moves: the stored format, plus for a dense path
        over a quantized format the temporary dense copy written and read again."""
        if kernel in ("packed", self.native_kernel):
            return self.nbytes
        size = 4 if kernel == "dense-fp32" else 2
        return self.nbytes + 2 * self.out_features * self.in_features * size

    native_kernel = "packed"
    # How much faster than the native kernel a dense one must be, at two row counts in a row, to
    # take over in the kernel table: measured busy, one bucket's times flipped by 10-30% (issue 24:
    # a busy machine's table chose dense kernels at 32-64 rows where a quiet one chose packed).
    dense_margin = 0.25


def _dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)


class DenseWeight(WeightStorage):
    """Plain weights in float32, bfloat16 or float16.

    float32 on the CPU is laid out for the fastest GEMM this torch has. oneDNN's inner product on
    its own packed weight layout where torch has oneDNN (measured on this 2-core EPYC, a layer's
    weights streamed from memory: 36 GB/s for a decode row against 21 for MKL's x @ W and 18 for
    F.linear, and 2-2.7x faster than MKL at 2 to 512 rows; torch's MKL takes slow paths on AMD
    CPUs); else columns ([in, out]) multiplied as x @ W (faster than F.linear's [out, in] for a
    decode row). A tensor another module still reads as rows (a tied LM head is the embedding) is
    kept as given: `relayout=False`."""

    def __init__(self, weight: torch.Tensor, relayout: bool = True):
        w = weight.detach()
        self.layout = "rows"
        if relayout and w.dtype == torch.float32 and w.device.type == "cpu":
            self.layout = "onednn" if onednn_linear_available() else "columns"
        self._stored: torch.Tensor
        if self.layout == "onednn":
            self._stored = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        elif self.layout == "columns":
            self._stored = w.t().contiguous()
        else:
            self._stored = w.contiguous()
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.kind = f"dense-{_short(w.dtype)}"
        self.native_kernel = self.kind

    @property
    def weight(self) -> torch.Tensor:
        """[out, in]: a view of what is stored, or for oneDNN's opaque layout a plain copy."""
        if self.layout == "onednn":
            return self._stored.to_dense()
        return self._stored.t() if self.layout == "columns" else self._stored

    def kernels(self) -> tuple[str, ...]:
        if self.dtype == torch.float32 or self._stored.device.type != "cpu":
            return (self.kind,)  # the reference: never rounded to a narrower type
        return (self.kind, "dense-fp32")

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == self.kind and self.layout == "onednn":
            return _onednn_linear(x.float(), self._stored).to(x.dtype)
        if kernel == self.kind and self.layout == "columns":
            return (x.to(self._stored.dtype) @ self._stored).to(x.dtype)
        if kernel == self.kind:
            return _dense(x, self._stored)
        return F.linear(x.float(), self.weight.float()).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.index_select(0, ids).to(dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self._stored,)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's inner product. A lone row takes another code path (a GEMV) whose last bits
    differ from the same row among others, so a sequence decoding alone would not get the
    tokens it gets batched: one row goes in twice (measured: every row is then bit for bit the
    same at any row count, on this machine's oneDNN; tests/engine/test_batch_truth.py); a row
    costs what two do, the weights are read once either way."""
    if x.shape[0] == 1:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), packed, None, "none", [], "")
        return y[:1]
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return y


_ONEDNN: bool | None = None


def onednn_linear_available() -> bool:
    """Whether this torch can pack a float32 weight for oneDNN and multiply by it, exactly as a
    float32 matmul does (probed once: the ops are torch internals that inductor's CPU weight
    prepacking uses, so a build without them or with a different signature falls back)."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(48, 32, generator=g), torch.randn(3, 32, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            got = _onednn_linear(x, packed)
            _ONEDNN = bool(torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN = False
    return _ONEDNN


class Int8RowWeight(WeightStorage):
    """int8 codes with one scale per output row: w = code * scale."""

    kind = "int8-row"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes = codes.to(torch.int8).contiguous()
        # the packed kernel takes the scales in the activations' dtype
        self.scales = scales.to(PACKED_ACTIVATION_DTYPE).contiguous()
        self.out_features, self.in_features = self.codes.shape

    def kernels(self) -> tuple[str, ...]:
        return ("packed", "dense-bf16", "dense-fp32")

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "packed":
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(
                x.to(PACKED_ACTIVATION_DTYPE), self.codes, self.scales
            )
            return y.to(x.dtype)
        dtype = torch.float32 if kernel == "dense-fp32" else torch.bfloat16
        return _dense(x, self.dequantize(dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scales.float()[:, None]).to(dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales)

    @staticmethod
    def cat(parts: list[Int8RowWeight]) -> Int8RowWeight:
        return Int8RowWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


class Int4GroupWeight(WeightStorage):
    """4-bit codes in groups of 32 input columns, a scale and a zero per group:
    w = (code - 8) * scale + zero, in torch's packed CPU layout (tinygemm)."""

    kind = "int4-g32"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """codes [N, K] in 0..15; scales, zeros [N, K / 32] (any float dtype, kept as bfloat16:
        the packed kernel's own precision, which every kernel then shares)."""
        n, k = codes.shape
        if k % INT4_GROUP:
            raise ValueError(f"input width {k} is not a multiple of the int4 group size {INT4_GROUP}")
        self.out_features, self.in_features = n, k
        zeros = _absorb_scale_rounding(codes, scales, zeros)
        # The packed layout holds whole blocks of output rows: pad with zero-weight rows (code 8,
        # scale 0, zero 0) and cut the padding off the output.
        block = int4_layout.rows_multiple()
        padded = -(-n // block) * block
        if padded != n:
            pad = padded - n
            codes = torch.cat([codes, codes.new_full((pad, k), INT4_MID)])
            scales = torch.cat([scales, scales.new_zeros((pad, scales.shape[1]))])
            zeros = torch.cat([zeros, zeros.new_zeros((pad, zeros.shape[1]))])
        self.padded_rows = padded
        self.packed = int4_layout.pack_cpu(codes)
        # [G, N, 2] (scale, zero) pairs, as the kernel takes them
        self.scales_and_zeros = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(PACKED_ACTIVATION_DTYPE).contiguous()
        )

    def kernels(self) -> tuple[str, ...]:
        return ("packed", "dense-bf16", "dense-fp32")

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "packed":
            y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(PACKED_ACTIVATION_DTYPE), self.packed, INT4_GROUP, self.scales_and_zeros
            )
            if self.padded_rows != self.out_features:
                y = y[:, : self.out_features]
            return y.to(x.dtype)
        dtype = torch.float32 if kernel == "dense-fp32" else torch.bfloat16
        return _dense(x, self.dequantize(dtype))

    def codes(self) -> torch.Tensor:
        """uint8 codes [N, K] (unpadded)."""
        codes = int4_layout.cpu_layout().unpack(self.packed, self.padded_rows, self.in_features)
        return codes[: self.out_features]

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 scales and zeros [N, K / 32] (unpadded), as the kernel holds them."""
        sz = self.scales_and_zeros[:, : self.out_features].float()
        return sz[..., 0].t(), sz[..., 1].t()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        scales, zeros = self.group_scales()
        groups = self.codes().float().reshape(n, k // INT4_GROUP, INT4_GROUP) - INT4_MID
        return (groups * scales[..., None] + zeros[..., None]).reshape(n, k).to(dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scales_and_zeros)

    @staticmethod
    def cat(parts: list[Int4GroupWeight]) -> Int4GroupWeight:
        scales, zeros = zip(*(p.group_scales() for p in parts))
        return Int4GroupWeight(torch.cat([p.codes() for p in parts]), torch.cat(scales), torch.cat(zeros))


def _absorb_scale_rounding(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Zeros that take up, per group, the mean error the scales' bfloat16 rounding makes.

    Rounding a group's scale moves each of its 32 weights by (code - 8) * (rounded - scale): an
    error correlated across the group, which a long dot product sums instead of averaging away.
    Its mean over the group is what the group's zero adds to every weight, so moving the zero by
    minus that mean leaves the least squared error the rounded scale allows. Measured on the
    packaged model's Q4_1 layers of blocks 0, 15 and 29: relative weight error 2.05e-3 -> 1.87e-3,
    a layer's packed output 3.12e-3 -> 3.00e-3; teacher-forced top-1 against the float32 twin on
    the evaluation text 99.26% -> 99.50%. A scale already in bfloat16 moves nothing (idempotent).
    """
    exact = scales.float()
    rounded = exact.to(PACKED_ACTIVATION_DTYPE).float()
    n, k = codes.shape
    mean_code = codes.reshape(n, k // INT4_GROUP, INT4_GROUP).float().mean(-1) - INT4_MID
    return zeros.float() - (rounded - exact) * mean_code


class Q8BlockWeight(WeightStorage):
    """GGUF Q8_0 kept as it is: int8 codes with one float16 scale per 32 input columns.

    torch's int8 kernel holds one scale per output row, so the block scales are applied outside
    it: one packed int8 matmul per block of 32 columns (unit scales), each block's partial result
    scaled by its float16 scales in float32 and summed. The weights multiplied are exactly the
    GGUF's; only the activations are rounded to bfloat16 inside the kernel."""

    kind = "q8_0"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        """codes int8 [N, K]; scales [N, K / 32] float16."""
        n, k = codes.shape
        if k % INT4_GROUP:
            raise ValueError(f"input width {k} is not a multiple of the Q8_0 block size 32")
        self.out_features, self.in_features = n, k
        blocks = k // INT4_GROUP
        # block-major [G, N, 32]: each block's codes contiguous for its own kernel call
        self.block_codes = codes.to(torch.int8).reshape(n, blocks, INT4_GROUP).permute(1, 0, 2).contiguous()
        self.block_scales = scales.to(torch.float16).t().contiguous()  # [G, N]
        self._unit = torch.ones(n, dtype=PACKED_ACTIVATION_DTYPE)

    def kernels(self) -> tuple[str, ...]:
        return ("packed", "dense-bf16", "dense-fp32")

    def matmul(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel != "packed":
            dtype = torch.float32 if kernel == "dense-fp32" else torch.bfloat16
            return _dense(x, self.dequantize(dtype))
        blocks = self.block_codes.shape[0]
        xb = x.to(PACKED_ACTIVATION_DTYPE).reshape(x.shape[0], blocks, INT4_GROUP)
        out: torch.Tensor | None = None
        for g in range(blocks):
            part: torch.Tensor = torch.ops.aten._weight_int8pack_mm(xb[:, g], self.block_codes[g], self._unit)
            part = part.float().mul_(self.block_scales[g].float())
            out = part if out is None else out.add_(part)
        assert out is not None, "a Q8_0 layer has at least one block of 32 inputs"
        return out.to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantized rows (an embedding lookup): [len(ids), K]."""
        codes = self.block_codes.index_select(1, ids).float()  # [G, T, 32]
        scaled = codes * self.block_scales.index_select(1, ids).float()[..., None]
        return scaled.permute(1, 0, 2).reshape(ids.numel(), self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features), dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.block_codes, self.block_scales)

    def per_row_int8(self, chunk_rows: int = 4096) -> Int8RowWeight:
        """The same weights requantized with one scale per row (an approximation: a row's blocks
        share its largest scale), a few thousand rows at a time so no float copy of the whole
        layer is ever held."""

        codes = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scales = torch.empty(self.out_features)
        for start in range(0, self.out_features, chunk_rows):
            ids = torch.arange(start, min(start + chunk_rows, self.out_features))
            codes[ids], scales[ids] = quantize_int8_per_row(self.rows(ids))
        return Int8RowWeight(codes, scales)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
