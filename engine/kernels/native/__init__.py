"""kvscope's C kernels for GGUF blocks (kvk.c), loaded with ctypes.

`kernels()` is the library for this CPU (the best instruction set it runs: AVX-512 VNNI, AVX2, or
portable C), or None with `status()` saying why (no build and no compiler, or KVSCOPE_KVK=off);
the engine then keeps the types torch's packed kernels hold (Q4_0, Q4_1, Q4_K, Q8_0) on them and
dequantizes the rest, and its load notes say so.

A build made by `./dev setup` lives in engine/kernels/native/lib/ (the frozen app carries it);
without one, the library is built once into the user cache dir when a compiler is there (a few
seconds), named by the source's hash so that a stale build is never loaded. ctypes releases the
GIL for the call, so the GUI thread runs while a kernel does.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.cache_dirs import cache_root
from engine.kernels.huge_pages import huge_page_buffer

_c_int, _c_i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True, slots=True)
class Kvk:
    lib: ctypes.CDLL
    variant: str  # "avx512", "avx2", "portable"
    path: Path

    def supported(self, ggml_type: int) -> bool:
        return bool(self.lib.kvk_supported(ggml_type))

    def row_bytes(self, ggml_type: int, k: int) -> int:
        return int(self.lib.kvk_row_bytes(ggml_type, k))

    def matmul(
        self,
        ggml_type: int,
        rows: np.ndarray,
        k: int,
        x: torch.Tensor,
        exact: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x float32 [R, k] (rows contiguous) times the weight rows whose addresses `rows` holds
        (row_addresses: one tensor, several fused, or a permutation) -> float32 [R, len(rows)].
        `exact`: float32 activations (every weight decoded to float32), else 16-bit activation
        codes (one scale per 256 inputs)."""
        check_table(rows)
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k:
            raise ValueError(
                f"activations must be float32 [rows, {k}] with contiguous rows, got {tuple(x.shape)} {x.dtype}"
            )
        r = x.shape[0]
        if out is None:
            out = torch.empty(r, rows.shape[0], dtype=torch.float32)
        fn = self.lib.kvk_matmul_f32 if exact else self.lib.kvk_matmul
        status = fn(
            ggml_type,
            rows.ctypes.data,
            rows.shape[0],
            k,
            x.data_ptr(),
            x.stride(0),
            r,
            out.data_ptr(),
            out.stride(0),
        )
        if status != 0:
            raise RuntimeError(f"kvk_matmul refused GGML type {ggml_type} with {k} inputs (status {status})")
        return out

    def dequantize_rows(self, ggml_type: int, rows: np.ndarray, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (of the address table `rows`) as float32 [len(ids), k], bit for bit gguf's
        dequantization."""
        check_table(rows)
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows.shape[0]):
            raise IndexError(f"row ids outside 0..{rows.shape[0] - 1}")
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        status = self.lib.kvk_dequantize_rows(
            ggml_type, rows.ctypes.data, k, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        if status != 0:
            raise RuntimeError(f"kvk_dequantize_rows refused GGML type {ggml_type}")
        return out

    def dequantize_bf16(
        self, ggml_type: int, rows: np.ndarray, k: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The weight rows [len(rows), k] rounded to bfloat16 (a dense kernel's temporary copy)."""
        check_table(rows)
        if out is None:
            out = torch.empty(rows.shape[0], k, dtype=torch.bfloat16)
        status = self.lib.kvk_dequantize_bf16(ggml_type, rows.ctypes.data, rows.shape[0], k, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"kvk_dequantize_bf16 refused GGML type {ggml_type}")
        return out

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, RMSNorm of it times weight) for float32 rows [R, n] (layer_ops.c); with
        no residual, (x, its norm). The sum is written into x: the residual stream in place."""
        rows, n = x.shape
        if (
            x.dtype != torch.float32
            or weight.dtype != torch.float32
            or weight.numel() != n
            or x.stride(1) != 1
            or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1))
        ):
            raise ValueError("add_rms_norm takes float32 rows [R, n] with contiguous rows and a weight of n")
        h = torch.empty(rows, n, dtype=torch.float32)
        res_ptr, res_ld = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
        status = self.lib.kvk_add_rms_norm(
            x.data_ptr(), x.stride(0), res_ptr, res_ld, x.data_ptr(), x.stride(0),
            weight.data_ptr(), eps, rows, n, h.data_ptr(), n,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError("kvk_add_rms_norm refused its shapes")
        return x, h

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE in place on qk [R, heads, d] (float32, each head's dims contiguous) over the first
        width = cos.shape[-1] dims: x * cos + roll(x, width / 2) * sin, sin's first half negated
        (cos, sin float32 [R, width] contiguous), as the own forward computes it in torch."""
        rows, heads, d = qk.shape
        width = cos.shape[-1]
        if (
            qk.dtype != torch.float32
            or qk.stride(2) != 1
            or width > d
            or cos.shape != (rows, width)
            or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("rope_ takes float32 qk [R, heads, d] and cos/sin [R, width <= d]")
        status = self.lib.kvk_rope(
            qk.data_ptr(),
            qk.stride(0),
            qk.stride(1),
            rows,
            heads,
            width,
            cos.data_ptr(),
            sin.data_ptr(),
            width,
        )
        if status != 0:
            raise RuntimeError("kvk_rope refused its shapes")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a fused gate|up output [R, 2 * inter] (float32, rows contiguous):
        float32 [R, inter] (layer_ops.c; the fused decoder layer computes the same)."""
        rows, width = gate_up.shape
        if gate_up.dtype != torch.float32 or gate_up.stride(1) != 1 or width % 2:
            raise ValueError("silu_mul takes float32 [rows, 2 * inter] with contiguous rows")
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        status = self.lib.kvk_silu_mul(
            gate_up.data_ptr(), gate_up.stride(0), rows, width // 2, out.data_ptr(), width // 2
        )
        if status != 0:
            raise RuntimeError("kvk_silu_mul refused its shapes")
        return out

    def argmax_logsumexp(self, scores: torch.Tensor) -> tuple[int, float] | None:
        """(first index of the largest, log-sum-exp) of float32 scores [n] (contiguous, on the
        CPU); None when they hold a NaN."""
        index, lse = ctypes.c_int64(), ctypes.c_float()
        status = self.lib.kvk_argmax_logsumexp(
            scores.data_ptr(), scores.numel(), ctypes.byref(index), ctypes.byref(lse)
        )
        return None if status else (index.value, lse.value)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: list[list[int]],
        starts: list[int],
        stops: list[int],
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        probs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [R, heads, d] float32; pools [num_blocks, kv_heads, block_size, d] (float32, float16,
        bfloat16, or int8 with float16 scales [num_blocks, kv_heads, block_size]). Row r attends
        positions [starts[r], stops[r]) through tables[r]. -> (out [R, heads, d] float32, the
        probabilities [R, heads, longest] when asked)."""
        rows, heads, d = q.shape
        kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
        kinds = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
        if k_pool.dtype not in kinds or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError(f"a KV pool of {k_pool.dtype} (contiguous float32/16, bfloat16 or int8)")
        q = q.float().contiguous()
        flat = [b for t in tables for b in t]
        offsets = np.cumsum([0, *map(len, tables)])[:-1].astype(np.int64)
        table_arr = np.asarray(flat or [0], dtype=np.int32)
        start_arr, stop_arr = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        out = torch.empty(rows, heads, d, dtype=torch.float32)
        width = int((stop_arr - start_arr).max()) if rows else 0
        prob_out = torch.empty(rows, heads, width, dtype=torch.float32) if probs else None
        sink_arr = None if sinks is None else sinks.float().contiguous()
        status = self.lib.kvk_paged_attention(
            q.data_ptr(),
            heads * d,
            rows,
            heads,
            d,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            kinds[k_pool.dtype],
            None if k_scales is None else k_scales.data_ptr(),
            None if v_scales is None else v_scales.data_ptr(),
            block_size,
            kv_heads,
            table_arr.ctypes.data,
            offsets.ctypes.data,
            start_arr.ctypes.data,
            stop_arr.ctypes.data,
            scale,
            softcap or 0.0,
            None if sink_arr is None else sink_arr.data_ptr(),
            out.data_ptr(),
            heads * d,
            None if prob_out is None else prob_out.data_ptr(),
            width,
        )
        if status != 0:
            raise ValueError("kvk_paged_attention refused its arguments (a row with no position?)")
        return out, prob_out

    def unpack_block(
        self, ggml_type: int, block: np.ndarray, weights: int, subs: int
    ) -> tuple[np.ndarray, ...]:
        """One block's codes and per-sub-block (a, b): w = a * code + b (tests)."""
        codes = np.zeros(weights, dtype=np.uint8)
        a = np.zeros(subs, dtype=np.float32)
        b = np.zeros(subs, dtype=np.float32)
        block = np.ascontiguousarray(block)
        if self.lib.kvk_unpack_block(
            ggml_type, block.ctypes.data, codes.ctypes.data, a.ctypes.data, b.ctypes.data
        ):
            raise RuntimeError(f"kvk_unpack_block refused GGML type {ggml_type}")
        return codes, a, b

    def repack_panels(self, ggml_type: int, rows: np.ndarray, k: int) -> np.ndarray | None:
        """The rows whose addresses `rows` holds, repacked into panels of 16 rows side by side
        (panels.c: the same bytes, outputs in vector lanes), or None where this build multiplies
        no panels of this type."""
        check_table(rows)
        size = int(self.lib.kvk_panel_bytes(ggml_type, rows.shape[0], k))
        if size < 0:
            return None
        panels = huge_page_buffer(size)  # streamed once a decode step: 2 MiB pages where the OS gives them
        if self.lib.kvk_repack_panels(ggml_type, rows.ctypes.data, rows.shape[0], k, panels.ctypes.data):
            raise RuntimeError(f"kvk_repack_panels refused GGML type {ggml_type} with {k} inputs")
        return panels

    def panel_weights(self, ggml_type: int, panels: np.ndarray, n: int, k: int) -> torch.Tensor:
        """The weights panels hold, float32 [n, k] as gguf dequantizes them (tests)."""
        out = torch.empty(n, k, dtype=torch.float32)
        if self.lib.kvk_panel_dequantize(ggml_type, panels.ctypes.data, n, k, out.data_ptr()):
            raise RuntimeError(f"kvk_panel_dequantize refused GGML type {ggml_type}")
        return out

    def pair_product_rate(self, iterations: int = 1 << 19, repeats: int = 3) -> float | None:
        """Products of 16-bit pairs per second these cores reach on registers alone, at the
        threads torch runs (panels.c's probe: the roof under the panels' arithmetic), best of
        `repeats`; None where this build has no VNNI. A few milliseconds a repeat."""
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            threads = self.lib.kvk_pair_product_probe(iterations)
            seconds = time.perf_counter() - start
            if threads < 0:
                return None
            best = max(best, threads * iterations * 24 * 32 / seconds)  # a round: 24 vpdpwssd of 32
        return best

    def quantize_rows(self, ggml_type: int, x: torch.Tensor, scalar: bool = False) -> np.ndarray:
        """Activations float32 [R, k] quantized as kvk_matmul quantizes them for `ggml_type`: the
        bytes of this build's layout [R, row stride], by its own routine or, with `scalar`, by
        the portable loop (tests: both write the same bytes)."""
        x = x.float().contiguous()
        rows, k = x.shape
        stride = self.lib.kvk_quantize_rows(ggml_type, k, x.data_ptr(), rows, None, 0)
        if stride < 0:
            raise RuntimeError(f"kvk_quantize_rows refused GGML type {ggml_type} with {k} inputs")
        out = np.zeros((rows, stride), dtype=np.uint8)
        self.lib.kvk_quantize_rows(ggml_type, k, x.data_ptr(), rows, out.ctypes.data, int(scalar))
        return out


def check_table(rows: np.ndarray) -> None:
    """A table of row addresses (row_addresses), not the blocks themselves: the kernels would read
    the bytes of anything else as addresses."""
    if (
        not isinstance(rows, np.ndarray)
        or rows.dtype != np.uint64
        or rows.ndim != 1
        or not rows.flags.c_contiguous
    ):
        raise TypeError("kvk takes a table of row addresses (engine.kernels.native.row_addresses)")


def visit_order(table: np.ndarray) -> np.ndarray | None:
    """The outputs of a row table in its rows' address order (kvk_matmul_visit: a decode row
    streams the weights as the file holds them), or None where the table already is in that order."""
    if table.shape[0] < 2 or bool(np.all(table[1:] > table[:-1])):
        return None
    return np.argsort(table, kind="stable").astype(np.int64)


def row_addresses(blocks: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """The address of each row of `blocks` (uint8 [rows, bytes per row]), in `order` when given:
    the table the kernels read rows through. The table holds raw addresses: keep `blocks` alive."""
    base = blocks.ctypes.data
    index = (
        np.arange(blocks.shape[0], dtype=np.uint64) if order is None else np.asarray(order, dtype=np.uint64)
    )
    table: np.ndarray = (np.uint64(base) + index * np.uint64(blocks.strides[0])).astype(np.uint64)
    return table


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvk_isa.restype = _c_int
    lib.kvk_supported.argtypes, lib.kvk_supported.restype = [_c_int], _c_int
    lib.kvk_row_bytes.argtypes, lib.kvk_row_bytes.restype = [_c_int, _c_i64], _c_i64
    matmul: list[Any] = [_c_int, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64]
    for fn in (lib.kvk_matmul, lib.kvk_matmul_f32):
        fn.argtypes, fn.restype = matmul, _c_int
    lib.kvk_matmul_visit.argtypes, lib.kvk_matmul_visit.restype = [*matmul[:2], _ptr, *matmul[2:]], _c_int
    lib.kvk_dequantize_rows.argtypes = [_c_int, _ptr, _c_i64, _ptr, _c_i64, _ptr]
    lib.kvk_dequantize_rows.restype = _c_int
    lib.kvk_dequantize_bf16.argtypes = [_c_int, _ptr, _c_i64, _c_i64, _ptr]
    lib.kvk_dequantize_bf16.restype = _c_int
    lib.kvk_paged_attention.argtypes = [
        _ptr,
        _c_i64,
        _c_i64,
        _c_int,
        _c_int,
        _ptr,
        _ptr,
        _c_int,
        _ptr,
        _ptr,
        _c_i64,
        _c_int,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_float,
        ctypes.c_float,
        _ptr,
        _ptr,
        _c_i64,
        _ptr,
        _c_i64,
    ]
    lib.kvk_paged_attention.restype = _c_int
    lib.kvk_unpack_block.argtypes, lib.kvk_unpack_block.restype = [_c_int, _ptr, _ptr, _ptr, _ptr], _c_int
    lib.kvk_quantize_rows.argtypes = [_c_int, _c_i64, _ptr, _c_i64, _ptr, _c_int]
    lib.kvk_quantize_rows.restype = _c_i64
    lib.kvk_add_rms_norm.argtypes = [_ptr, _c_i64, _ptr, _c_i64, _ptr, _c_i64, _ptr, ctypes.c_float]
    lib.kvk_add_rms_norm.argtypes += [_c_i64, _c_i64, _ptr, _c_i64]
    lib.kvk_add_rms_norm.restype = _c_int
    lib.kvk_rope.argtypes = [_ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_int, _ptr, _ptr, _c_i64]
    lib.kvk_rope.restype = _c_int
    lib.kvk_silu_mul.argtypes, lib.kvk_silu_mul.restype = [_ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_i64], _c_int
    lib.kvk_argmax_logsumexp.argtypes = [_ptr, _c_i64, _ptr, _ptr]
    lib.kvk_argmax_logsumexp.restype = _c_int
    lib.kvk_decoder_layers.argtypes = [_ptr, _c_i64, _c_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
    lib.kvk_decoder_layers.restype = _c_int
    lib.kvk_to_f16.argtypes, lib.kvk_to_f16.restype = [_ptr, _c_i64, _ptr], _c_int
    lib.kvk_set_row_block_bytes.argtypes, lib.kvk_set_row_block_bytes.restype = [_c_i64], None
    lib.kvk_panel_bytes.argtypes, lib.kvk_panel_bytes.restype = [_c_int, _c_i64, _c_i64], _c_i64
    lib.kvk_repack_panels.argtypes, lib.kvk_repack_panels.restype = (
        [_c_int, _ptr, _c_i64, _c_i64, _ptr],
        _c_int,
    )
    lib.kvk_panel_dequantize.argtypes = [_c_int, _ptr, _c_i64, _c_i64, _ptr]
    lib.kvk_panel_dequantize.restype = _c_int
    lib.kvk_matmul_panels.argtypes, lib.kvk_matmul_panels.restype = [_c_int, _ptr, *matmul[2:]], _c_int
    lib.kvk_pair_product_probe.argtypes, lib.kvk_pair_product_probe.restype = [_c_i64], _c_int


def cpu_variants() -> list[str]:
    """The variants this CPU runs, best first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["portable"]
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"avx2", "fma", "f16c"} if capability in ("AVX2", "AVX512") else set()
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        out.append("avx512")
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    return [*out, "portable"]


def _cache_dir() -> Path:
    """Where kernels built on this machine go: the user cache dir (KVSCOPE_CACHE_DIR)."""
    return cache_root() / "kvk"


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def kernels() -> Kvk | None:
    """The library for this CPU (loaded once), or None: see status()."""
    with _LOCK:
        if "kvk" not in _STATE:
            _STATE["kvk"], _STATE["status"] = _load()
        found = _STATE["kvk"]
        return found if isinstance(found, Kvk) else None


def status() -> str:
    """One line: which kernels run GGUF blocks, or why none does."""
    lib = kernels()
    if lib is not None:
        return f"kvk {lib.variant} ({lib.path.name})"
    return str(_STATE.get("status", "not loaded"))


def _load() -> tuple[Kvk | None, str]:
    # not at the top: `python -m engine.kernels.native.build` imports this package first
    from engine.kernels.native import build

    if os.environ.get("KVSCOPE_KVK", "").lower() in ("0", "off", "no"):
        return None, "kvk kernels off (KVSCOPE_KVK=off)"
    digest = build.source_hash()
    wanted = cpu_variants()
    folders = [build.PACKAGE_LIB, _cache_dir()]
    for variant in wanted:
        for folder in folders:
            path = folder / build.library_name(variant, digest)
            if path.exists():
                return _open(path, variant)
    if build.compiler() is None:
        return None, "no kvk build and no C compiler: GGUF types run on torch's kernels or dequantized"
    try:
        path = build.build(wanted[0], _cache_dir())
    except (RuntimeError, OSError) as exc:
        return None, f"kvk could not be built ({str(exc).splitlines()[0]})"
    return _open(path, wanted[0])


def _open(path: Path, variant: str) -> tuple[Kvk | None, str]:
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as exc:
        return None, f"kvk library {path.name} could not be loaded ({exc})"
    return Kvk(lib, variant, path), ""
