"""KernelLinear: a linear layer over a WeightStorage, running each row segment through the kernel
its policy chose; and the fusion of projections that read the same input (q/k/v, gate/up) into
one layer, so a decode step makes one weight pass instead of three."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import DenseWeight, Int4GroupWeight, Int8RowWeight, WeightStorage

_Storage = TypeVar("_Storage", bound=WeightStorage)


class KernelLinear(nn.Module):
    def __init__(self, storage: WeightStorage, bias: torch.Tensor | None, policy: KernelPolicy):
        super().__init__()
        self.storage = storage
        self.in_features, self.out_features = storage.in_features, storage.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._through(self.storage, x)

    def storages(self) -> tuple[WeightStorage, ...]:
        """Every weight storage the layer holds (the model's byte count and kernel table)."""
        return (self.storage,)

    def _through(self, storage: WeightStorage, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features))
        record = self.policy.record
        segments = self.policy.plan(storage, rows)
        if len(segments) == 1:
            kernel = segments[0][2]
            y = storage.matmul(kernel, flat)
            record.add(storage, kernel)
        else:
            parts = []
            for start, stop, kernel in segments:
                parts.append(storage.matmul(kernel, flat[start:stop]))
                record.add(storage, kernel)
            y = torch.cat(parts)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.storage.dequantize(torch.float32)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.storage.kind}"


# The LM head's best candidates per row, recomputed exactly (see KernelHead).
REFINED_CANDIDATES = 64


def _per_row_products(weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[R, K, H] . [R, H] -> [R, K]. A lone row goes in twice: torch's batched product takes a
    matrix-vector path for one row whose last bits differ from the same row among others, and a
    sequence sampling alone would then not get the tokens it gets batched (issue 24)."""
    if weights.shape[0] == 1:
        return torch.einsum("rkh,rh->rk", weights.expand(2, -1, -1), hidden.expand(2, -1))[:1]
    return torch.einsum("rkh,rh->rk", weights, hidden)


class KernelHead(KernelLinear):
    """An LM head over weights whose fast kernels round the activations (packed int8 blocks and
    bfloat16 matmuls read the hidden state as bfloat16): the logits come from the fast kernel,
    then each row's top REFINED_CANDIDATES are recomputed in float32 from the exact weights of
    those rows alone. The argmax and the probabilities that matter are then those of the exact
    head (the rounding flips near-ties otherwise: on SmolLM2's Q8_0 head, 2.7% of the eval
    text's top-1 tokens); the tail keeps the fast kernel's values. The rows cost ~64 x hidden
    multiply-adds: nothing next to the head's vocabulary x hidden.

    `scout`, when given, is a cheaper copy of approximately the same weights that makes the pass
    over the whole vocabulary, the exact storage recomputing the top candidates. A GGUF Q8_0 head
    gets one (engine/model/gguf_native): its blocks' scales can only be applied block by block
    (one int8 kernel call per 32 inputs), a per-row int8 requantization is one call. Measured on
    SmolLM2's 49152 x 576 head, 2 threads: 1.57 -> 0.71 ms at one row, 8.1 -> 1.9 ms at eight, for
    27 MiB more and a 1.2e-2 relative error on the logits outside the recomputed top candidates."""

    def __init__(
        self,
        storage: WeightStorage,
        bias: torch.Tensor | None,
        policy: KernelPolicy,
        scout: WeightStorage | None = None,
    ):
        super().__init__(storage, bias, policy)
        self.scout = scout

    def storages(self) -> tuple[WeightStorage, ...]:
        return (self.storage,) if self.scout is None else (self.storage, self.scout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self._through(self.scout or self.storage, x)
        rows_of = getattr(self.storage, "rows", None)
        exact_pass = self.scout is None and self.storage.kind == "dense-fp32"
        if rows_of is None or logits.numel() == 0 or exact_pass:
            return logits
        flat = logits.reshape(-1, self.out_features)
        hidden = x.reshape(-1, self.in_features).float()
        top = flat.topk(min(REFINED_CANDIDATES, self.out_features), dim=-1).indices  # [R, K]
        weights = rows_of(top.reshape(-1), torch.float32).reshape(*top.shape, self.in_features)
        exact = _per_row_products(weights, hidden)
        if self.bias is not None:
            exact = exact + self.bias.float()[top]
        flat.scatter_(1, top, exact.to(flat.dtype))
        return flat.reshape(logits.shape)


def as_kernel_linear(module: nn.Module, policy: KernelPolicy) -> KernelLinear | None:
    """A KernelLinear over a plain nn.Linear's weights (sharing them), or the module itself when it
    already is one; None for layers of other schemes (bitsandbytes, fp8, w8a8 keep their own)."""
    if isinstance(module, KernelLinear):
        return module
    if type(module) is nn.Linear:
        return KernelLinear(DenseWeight(module.weight), module.bias, policy)
    return None


def cat_storages(parts: list[WeightStorage]) -> WeightStorage | None:
    """One storage holding `parts` stacked along the output rows, or None when they differ in
    format (then they stay separate)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        return None
    if dense := _all_of(parts, DenseWeight):
        return DenseWeight(torch.cat([p.weight for p in dense]))
    if int8 := _all_of(parts, Int8RowWeight):
        return Int8RowWeight.cat(int8)
    if int4 := _all_of(parts, Int4GroupWeight):
        return Int4GroupWeight.cat(int4)
    return None


def _all_of(parts: list[WeightStorage], cls: type[_Storage]) -> list[_Storage]:
    """`parts` as a list of `cls` when every one is one, else empty."""
    typed = [p for p in parts if isinstance(p, cls)]
    return typed if len(typed) == len(parts) else []


class FusedProjection(nn.Module):
    """One KernelLinear computing several projections of the same input at once.

    The model's own code still calls each projection separately (`q_proj(x)`, `k_proj(x)`, ...):
    each is replaced by a `ProjectionSlice` that asks this module, which runs the fused matmul on
    the first call with a given input tensor and hands out the slices to the others. The result
    is dropped once every slice has taken its part, so nothing outlives the layer's forward."""

    def __init__(self, linear: KernelLinear, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._pending = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._input is not x or self._pending == 0:
            self._parts = tuple(self.linear(x).split(self.sizes, dim=-1))
            self._input, self._pending = x, len(self.sizes)
        out = self._parts[index]
        self._pending -= 1
        if self._pending == 0:
            self._input, self._parts = None, ()
        return out


class ProjectionSlice(nn.Module):
    fused: FusedProjection

    def __init__(self, fused: FusedProjection, index: int):
        super().__init__()
        # not a submodule: the fused layer is registered once on the layer that owns it
        object.__setattr__(self, "fused", fused)
        self.index = index
        self.out_features = fused.sizes[index]
        self.in_features = fused.linear.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


# (owner attribute, projection names) groups fused at load, when all are present
FUSABLE_GROUPS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


def fuse_projections(model: nn.Module, policy: KernelPolicy) -> int:
    """Turn every plain or kernel linear of the model into a KernelLinear under `policy`, and fuse
    q/k/v and gate/up where a layer has them in one format. Returns the number of fused groups."""
    for module in model.modules():
        if isinstance(module, KernelLinear):
            module.policy = policy  # quantizers build their layers before the model has a policy
    fused = 0
    for module in list(model.modules()):
        for owner_name, names, fused_name in FUSABLE_GROUPS:
            owner = getattr(module, owner_name, None)
            if owner is None or not all(isinstance(getattr(owner, n, None), nn.Module) for n in names):
                continue
            maybe = [as_kernel_linear(getattr(owner, n), policy) for n in names]
            linears = [lin for lin in maybe if lin is not None]
            if len(linears) != len(maybe):
                continue
            storage = cat_storages([lin.storage for lin in linears])
            if storage is None:
                continue
            biases = [lin.bias for lin in linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [b if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, linears)]
                )
            group = FusedProjection(
                KernelLinear(storage, bias, policy), [lin.out_features for lin in linears]
            )
            setattr(owner, fused_name, group)
            for index, name in enumerate(names):
                setattr(owner, name, ProjectionSlice(group, index))
            fused += 1
    _wrap_remaining(model, policy)
    return fused


def _wrap_remaining(model: nn.Module, policy: KernelPolicy) -> None:
    """Every plain linear not fused becomes a KernelLinear too, the LM head included (one path
    for every layer; a tied head keeps sharing the embedding's tensor)."""
    get_head = getattr(model, "get_output_embeddings", None)
    get_embedding = getattr(model, "get_input_embeddings", None)
    head = get_head() if get_head is not None else None
    embedding = get_embedding() if get_embedding is not None else None
    tied = getattr(embedding, "weight", None)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        kind = KernelHead if module is head else KernelLinear
        # a head tied to the embedding keeps its rows: the lookup reads the same tensor
        relayout = not (tied is not None and module.weight is tied)
        setattr(parent, child, kind(DenseWeight(module.weight, relayout), module.bias, policy))
