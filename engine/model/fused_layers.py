"""A Llama-shaped model on kvk, its decoder layers in one C call a step (layer_ops.c's
kvk_decoder_layers, a kvk_decoder_layer each).

The own forward (llama_forward.py) runs a layer as ~10 Python and torch calls: the norms, the
four projections through KernelLinear and the kernel table, RoPE, the K/V write, attention, the
SiLU gate. At a decode row each costs a few microseconds of dispatch, not arithmetic: on the
packaged SmolLM2-135M (30 layers) ~3 ms of a ~10 ms token went outside the matmuls and the
attention. Where every layer is the plain shape (q|k|v and gate|up each one projection of GGUF parts on
kvk: one format, or side by side as Q4_K_M's Q4_K and Q6_K; Llama's RMSNorms, RoPE, SiLU, a
float32 or float16 pool) and the kernel table picks kvk for the step's rows, the layer runs as
one call of the same C functions in the same order on the same values: the same bits as op by op
(tests/engine/test_fused_layers.py), so a sequence's tokens do not depend on which path ran.

Anything else runs op by op: a probe (logit lens, steering, attention maps, expert routes), a
hooked module, an int8 or bfloat16 KV pool, another kernel for these rows.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import KernelLinear, StackedLinear
from engine.kernels.native import Kvk
from engine.kernels.policy import KernelPolicy
from engine.model.row_attention import POOL_KINDS

if TYPE_CHECKING:
    from engine.model.kv_storage import PagedKVStorage
    from engine.model.paged_attention import PagedBatch

_p, _i32, _i64, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


MAX_PARTS = 4  # layer_ops.c's kvk_proj: q|k|v across three formats fits
# The pools a fused layer writes (layer_ops.c's store_kv: float16 rounded as PagedKVStorage.write
# rounds) and attends.
_FUSED_POOLS = (torch.float32, torch.float16)


class _Part(ctypes.Structure):  # layer_ops.c's kvk_part
    _fields_ = [
        ("t", _i32), ("unused", _i32), ("n", _i64), ("rows", _p), ("bias", _p), ("visit", _p), ("panels", _p)
    ]  # fmt: skip


class _Proj(ctypes.Structure):  # layer_ops.c's kvk_proj
    _fields_ = [("count", _i32), ("unused", _i32), ("part", _Part * MAX_PARTS)]


class _LayerSpec(ctypes.Structure):  # layer_ops.c's kvk_layer_spec
    _fields_ = [
        *[(n, _Proj) for n in ("qkv", "o", "gu", "down")],
        *[(n, _i32) for n in ("heads", "kv_heads", "d", "rope_width")],
        ("hidden", _i64),
        ("inter", _i64),
        *[(n, _p) for n in ("norm1", "norm2", "sinks")],
        *[(n, _f) for n in ("eps", "scale", "softcap", "unused")],
    ]


class _LayerStep(ctypes.Structure):  # layer_ops.c's kvk_layer_step
    _fields_ = [
        ("rows", _i64),
        ("block_size", _i64),
        ("kv_type", _i64),
        *[
            (n, _p)
            for n in ("x", "kv_rows", "tables", "table_start", "stops", "h", "qkv", "attn", "gu", "m", "y")
        ],
    ]


@dataclass(slots=True)
class _Fused:
    spec: _LayerSpec
    rope: int  # which of the step's RoPE tables
    window: int | None
    modules: tuple[nn.Module, ...]  # hooks on any of them send the step op by op
    kept: tuple[Any, ...]  # what the spec's addresses point into


def _kvk_parts(module: nn.Module | None) -> list[tuple[GGUFWeight, torch.Tensor | None]] | None:
    """A projection as kvk matmuls side by side: [(its GGUF storage, its bias)] of a KernelLinear
    or of each part of a StackedLinear (in output order); None where any part is not GGUF."""
    if type(module) is KernelLinear:
        storage = module.storage
        if not isinstance(storage, GGUFWeight):
            return None
        bias = None if module.bias is None else module.bias.detach().float().contiguous()
        return [(storage, bias)]
    if type(module) is StackedLinear:
        parts: list[tuple[GGUFWeight, torch.Tensor | None]] = []
        for part in module.parts:
            inner = _kvk_parts(part)
            if inner is None:
                return None
            parts += inner
        return parts
    return None


def _policy_of(module: nn.Module) -> KernelPolicy:
    """The kernel table a projection's KernelLinears share (one per loaded model)."""
    while type(module) is StackedLinear:
        module = module.parts[0]
    assert isinstance(module, KernelLinear)
    return module.policy


def _proj(parts: list[tuple[GGUFWeight, torch.Tensor | None]]) -> _Proj:
    proj = _Proj(count=len(parts))
    for i, (storage, bias) in enumerate(parts):
        visit = None if storage.visit is None else storage.visit.ctypes.data
        proj.part[i] = _Part(
            int(storage.ggml_type),
            0,
            storage.out_features,
            storage.row_table.ctypes.data,
            _address(bias),
            visit,
            None if storage.panels is None else storage.panels.ctypes.data,
        )
    return proj


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayers:
    """Every layer of one model as one kvk_decoder_layers call, or None where a layer is not plain."""

    def __init__(
        self,
        lib: Kvk,
        policy: KernelPolicy,
        layers: list[_Fused],
        storages: list[GGUFWeight],
        hidden: int,
        inter: int,
    ):
        self.lib = lib
        self.policy = policy  # the projections' kernel table and step record
        self.layers = layers
        self.modules = [m for layer in layers for m in layer.modules]
        self.kinds = {s.kind: s for s in storages}  # one storage per format: the step's kernel check
        self.hidden, self.inter = hidden, inter
        self.qkv_width = int(layers[0].spec.heads + 2 * layers[0].spec.kv_heads) * int(layers[0].spec.d)
        self.heads_width = int(layers[0].spec.heads) * int(layers[0].spec.d)
        # what a step's linears ran and read, for its StepRecord (the same as op by op)
        self.uses: dict[str, int] = {}
        for st in storages:
            self.uses[f"{st.kind}/kvk"] = self.uses.get(f"{st.kind}/kvk", 0) + 1
        self.weight_bytes = sum(st.bytes_read("kvk") for st in storages)
        # engine/bench/decode_split.py's: seconds in [matmuls, attention, the rest] of the layers
        self.clock: np.ndarray | None = None
        self.spec_refs = (_p * len(layers))(*(ctypes.addressof(layer.spec) for layer in layers))
        # (the storage's pool address list, held so that its identity stays its own; k; v)
        self._pool_table: tuple[list[tuple[int, int]], Any, Any] | None = None

    def _pools(self, storage: PagedKVStorage) -> tuple[Any, Any]:
        """Each layer's K and V pool addresses as C arrays, made again only when the pool changes."""
        pools = storage.kv_addresses
        if self._pool_table is None or self._pool_table[0] is not pools:
            n = len(self.layers)
            k = (_p * n)(*(pools[i][0] for i in range(n)))
            v = (_p * n)(*(pools[i][1] for i in range(n)))
            self._pool_table = (pools, k, v)
        return self._pool_table[1], self._pool_table[2]

    @classmethod
    def build(cls, lib: Kvk, plan_layers: list[Any], heads: int, kv_heads: int, d: int) -> FusedLayers | None:
        fused: list[_Fused] = []
        storages: list[GGUFWeight] = []
        inters = set()
        for layer in plan_layers:
            projections = [_kvk_parts(m) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
            if (
                layer.plain_norms is None
                or layer.q_norm is not None
                or layer.rope is None
                or layer.act is not torch.nn.functional.silu
                or layer.how.sinks is not None
                or any(p is None or len(p) > MAX_PARTS for p in projections)
                or layer.qkv_sizes != [heads * d, kv_heads * d, kv_heads * d]
                or len(layer.gate_up_sizes) != 2
                or layer.gate_up_sizes[0] != layer.gate_up_sizes[1]
            ):
                return None
            qkv, o, gu, down = (p for p in projections if p is not None)
            inter = layer.gate_up_sizes[0]
            inters.add(inter)
            norm1, norm2, eps = layer.plain_norms
            how = layer.how
            spec = _LayerSpec(
                _proj(qkv), _proj(o), _proj(gu), _proj(down),
                heads, kv_heads, d, 0,
                sum(st.out_features for st, _ in down), inter,
                norm1.data_ptr(), norm2.data_ptr(), None,
                eps, how.scaling if how.scaling is not None else d**-0.5, how.softcap or 0.0, 0.0,
            )  # fmt: skip
            modules = (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)
            weights = [part for p in (qkv, o, gu, down) for part in p]
            kept = (norm1, norm2, *weights)
            fused.append(_Fused(spec, layer.rope, how.window, modules, kept))
            storages += [st for st, _ in weights]
        if not fused or len(inters) != 1:
            return None
        policy = _policy_of(plan_layers[0].o_proj)
        return cls(lib, policy, fused, storages, int(fused[0].spec.hidden), inters.pop())

    def usable(self, storage: PagedKVStorage, batch: PagedBatch, rows: int) -> bool:
        """Whether this step can run fused: a float32 or float16 pool, every row attending
        through kvk's row plan with nothing recording, kvk chosen for these rows, no hook on any
        projection."""
        if storage.kv[0].dtype not in _FUSED_POOLS or batch.recorder is not None:
            return False
        plan = batch.row_plan()
        if plan is None or plan.count != rows:
            return False
        for st in self.kinds.values():
            if any(kernel != "kvk" for _, _, kernel in self.policy.plan(st, rows)):
                return False
        return all(not (m._forward_hooks or m._forward_pre_hooks) for m in self.modules)

    def run(self, x: torch.Tensor, ropes: list[Any], storage: PagedKVStorage, batch: PagedBatch,
            slots: torch.Tensor, middle: tuple[int, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """x [T, hidden] (contiguous float32, updated in place) through every layer -> (x, and
        with `middle` = (layer m, rows) the residual entering layer m at those rows, else None)."""
        rows = x.shape[0]
        plan = batch.row_plan()
        assert plan is not None
        h, qkv, attn, gu, m, y = (
            torch.empty(rows, width, dtype=torch.float32)
            for width in (
                self.hidden,
                self.qkv_width,
                self.heads_width,
                2 * self.inter,
                self.inter,
                self.hidden,
            )
        )
        slot_rows = slots.to(torch.int64).contiguous()
        tables, table_start, _, stops = plan.addresses(None)
        step = _LayerStep(
            rows, storage.block_size, POOL_KINDS[storage.kv[0].dtype], x.data_ptr(), slot_rows.data_ptr(), tables, table_start, stops,
            h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gu.data_ptr(), m.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        tables_cs = [rope.rows() for rope in ropes]
        n = len(self.layers)
        cos, sin, starts = (_p * n)(), (_p * n)(), (_p * n)()
        for index, layer in enumerate(self.layers):
            c, s = tables_cs[layer.rope]
            cos[index], sin[index] = c.data_ptr(), s.data_ptr()
            if layer.spec.rope_width != c.shape[-1]:
                layer.spec.rope_width = c.shape[-1]
            starts[index] = plan.addresses(layer.window)[2]  # (the plan keeps each window's array)
        k_pools, v_pools = self._pools(storage)
        clock = None if self.clock is None else self.clock.ctypes.data

        def layers(first: int, stop: int) -> None:
            # the layers in one call: the GIL is taken back once (fused_layers: layer_ops.c)
            status = self.lib.lib.kvk_decoder_layers(
                self.spec_refs, first, stop, ctypes.byref(step), cos, sin, starts, k_pools, v_pools, clock
            )
            if status != 0:
                layer_index, part = divmod(status, 16)
                raise RuntimeError(f"kvk_decoder_layer refused layer {layer_index} (at its part {part})")

        seen = None
        if middle is not None and 0 < middle[0] < n:
            layers(0, middle[0])  # x, and layer m - 1's MLP output in y: its sum enters layer m
            picked = middle[1]
            seen = x.index_select(0, picked).add_(y.index_select(0, picked))
            layers(middle[0], n)
        else:
            layers(0, n)
        self.policy.record.add_uses(self.uses, self.weight_bytes)
        return x.add_(y), seen  # the last layer's MLP output (op by op: the next norm's residual)
