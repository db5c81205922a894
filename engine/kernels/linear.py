"""KernelLinear: a linear layer over a WeightStorage, running each row segment through the kernel
its policy chose; and the fusion of projections that read the same input (q/k/v, gate/up) into
one layer, so a decode step makes one weight pass instead of three."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.policy import KernelPolicy, table_key
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
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the forward's rows: 2-D
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
        return y if flat is x else y.reshape(*x.shape[:-1], self.out_features)

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
    """An LM head whose every logit the sampler, the probability panel and the server use.

    Over a GGUF tensor (GGUFWeight) every logit is computed exactly: each weight decoded to float32
    as gguf decodes it, times the float32 hidden state (kvk's float path): one copy of the head,
    no activation rounding, no approximation anywhere in the vocabulary.

    Over the other quantized storages (torch's packed int8/int4 kernels and bfloat16 matmuls read
    the hidden state as bfloat16) the logits come from the fast kernel, then each row's top
    REFINED_CANDIDATES are recomputed in float32 from the exact weights of those rows alone: the
    argmax and the probabilities that matter are then the exact head's (the rounding flips
    near-ties otherwise: on SmolLM2's Q8_0 head, 2.7% of the eval text's top-1 tokens); the tail
    keeps the fast kernel's values. The rows cost ~64 x hidden multiply-adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exact = getattr(self.storage, "exact_matmul", None)
        if exact is not None:
            flat = x.reshape(-1, self.in_features)
            logits: torch.Tensor = exact(flat) if flat.shape[0] else flat.new_zeros((0, self.out_features))
            if self.bias is not None:
                logits = logits + self.bias
            self.policy.record.add(self.storage, "exact")
            return logits.reshape(*x.shape[:-1], self.out_features)
        logits = self._through(self.storage, x)
        rows_of = getattr(self.storage, "rows", None)
        if rows_of is None or logits.numel() == 0 or self.storage.kind == "dense-fp32":
            return logits
        flat = logits.reshape(-1, self.out_features)
        hidden = x.reshape(-1, self.in_features).float()
        top = flat.topk(min(REFINED_CANDIDATES, self.out_features), dim=-1).indices  # [R, K]
        weights = rows_of(top.reshape(-1), torch.float32).reshape(*top.shape, self.in_features)
        refined = _per_row_products(weights, hidden)
        if self.bias is not None:
            refined = refined + self.bias.float()[top]
        flat.scatter_(1, top, refined.to(flat.dtype))
        return flat.reshape(logits.shape)


class StackedLinear(nn.Module):
    """Several KernelLinears over the same input, their outputs side by side: the fused q/k/v or
    gate/up of a layer whose parts are in different formats (a Q4_K_M file keeps some v and down
    projections in Q6_K) or in separate memory (a GGUF file's tensors are separate regions of the
    mapping: stacking them would copy the weights). Each part runs the kernel the table picks for
    its own format and rows."""

    def __init__(self, parts: list[KernelLinear] | list[KernelLinear | StackedLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._linears = tuple(parts)  # the same modules, typed (the ModuleList registers them)
        self.in_features: int = parts[0].in_features
        self.out_features: int = sum(p.out_features for p in parts)
        self._offsets = [0]
        for p in parts:
            self._offsets.append(self._offsets[-1] + p.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = flat.new_empty((flat.shape[0], self.out_features))
        for part, start, stop in zip(self._linears, self._offsets, self._offsets[1:]):
            out[:, start:stop] = part.forward(flat)
        return out.reshape(*x.shape[:-1], self.out_features)

    def storages(self) -> tuple[WeightStorage, ...]:
        return tuple(s for p in self._linears for s in p.storages())

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self._linears])


def kv_formats(model: nn.Module) -> frozenset[str]:
    """The kernel-table keys of the layers whose outputs reach the K/V a model writes: every
    KernelLinear but the LM head (a self-draft's head or the logits never touch the cache)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return frozenset(
        table_key(storage)
        for module in model.modules()
        if isinstance(module, (KernelLinear, StackedLinear)) and module is not head
        for storage in module.storages()
    )


def as_kernel_linear(module: nn.Module, policy: KernelPolicy) -> KernelLinear | None:
    """A KernelLinear over a plain nn.Linear's weights (sharing them), or the module itself when it
    already is one; None for layers of other schemes (bitsandbytes, fp8, w8a8 keep their own)."""
    if isinstance(module, KernelLinear):
        return module
    if type(module) is nn.Linear:
        return KernelLinear(DenseWeight(module.weight), module.bias, policy)
    return None


def cat_storages(parts: list[WeightStorage]) -> WeightStorage | None:
    """One storage holding `parts` stacked along the output rows (GGUF tensors of one type: one
    table of their rows, each left where the file has it), or None when they differ in format:
    then they run side by side (StackedLinear)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        return None
    if dense := _all_of(parts, DenseWeight):
        return DenseWeight(torch.cat([p.weight for p in dense]))
    if int8 := _all_of(parts, Int8RowWeight):
        return Int8RowWeight.cat(int8)
    if int4 := _all_of(parts, Int4GroupWeight):
        return Int4GroupWeight.cat(int4)
    if gguf := _all_of(parts, GGUFWeight):
        return GGUFWeight.cat(gguf) if len({p.in_features for p in gguf}) == 1 else None
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

    def __init__(self, linear: KernelLinear | StackedLinear, sizes: list[int]):
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
            sizes = [lin.out_features for lin in linears]
            # each run of one format as one layer; runs of different formats side by side
            runs = [_joined(run, policy) for run in _runs_of_one_format(linears)]
            fused_linear: KernelLinear | StackedLinear = runs[0] if len(runs) == 1 else StackedLinear(runs)
            group = FusedProjection(fused_linear, sizes)
            setattr(owner, fused_name, group)
            for index, name in enumerate(names):
                setattr(owner, name, ProjectionSlice(group, index))
            fused += 1
    _wrap_remaining(model, policy)
    return fused


def repack_for_kernels(model: nn.Module) -> None:
    """Every GGUF linear layer but the LM head (its exact pass reads the file's rows) repacked
    where this build has a faster layout for its type (GGUFWeight.use_panels: Q4_0, Q4_1,
    Q4_K and Q6_K on AVX-512 VNNI), after fusion, so that a fused projection is repacked once; the pages
    of the file it came from are handed back."""
    for storage in _linear_gguf_storages(model):
        storage.use_panels(release_file_pages=True)


def repacked_notes(model: nn.Module) -> list[str]:
    """The load notes of repack_for_kernels: which types' layers run repacked, and what the panels
    hold against the file's rows, or nothing."""
    held: dict[str, list[int]] = {}  # type -> [layers, the file's bytes, the panels' bytes]
    for storage in panel_storages(model):
        assert storage.panels is not None
        counts = held.setdefault(storage.ggml_type.name, [0, 0, 0])
        counts[0] += 1
        counts[1] += storage.file_bytes()
        counts[2] += storage.panels.nbytes
    return [
        f"{name} linears (x{n}) repacked at load into panels of 16 rows side by side ("
        + ("the same bytes" if panels == file else f"{panels / file - 1:+.1%} on the file's bytes")
        + ", the file's pages handed back): kvk's faster layout for them on this CPU"
        for name, (n, file, panels) in held.items()
    ]


def panel_storages(model: nn.Module) -> list[GGUFWeight]:
    """The linear layers' weights held as panels (repack_for_kernels), each once."""
    return [storage for storage in _linear_gguf_storages(model) if storage.panels is not None]


def _linear_gguf_storages(model: nn.Module) -> list[GGUFWeight]:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    found: dict[int, GGUFWeight] = {}
    for module in model.modules():
        if isinstance(module, KernelLinear) and module is not head:
            for storage in module.storages():
                if isinstance(storage, GGUFWeight):
                    found[id(storage)] = storage
    return list(found.values())


def _runs_of_one_format(linears: list[KernelLinear]) -> list[list[KernelLinear]]:
    """Consecutive projections grouped by format (q, k in Q4_K and v in Q6_K: two runs)."""
    runs: list[list[KernelLinear]] = []
    for lin in linears:
        if runs and runs[-1][0].storage.kind == lin.storage.kind:
            runs[-1].append(lin)
        else:
            runs.append([lin])
    return runs


def _joined(run: list[KernelLinear], policy: KernelPolicy) -> KernelLinear | StackedLinear:
    """One layer computing the run's projections side by side: one storage where the format can
    be joined (dense, int8, int4, GGUF tensors of one type), else the parts stacked."""
    if len(run) == 1:
        return run[0]
    storage = cat_storages([lin.storage for lin in run])
    if storage is None:
        return StackedLinear(run)
    biases = [lin.bias for lin in run]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, run)]
        )
    return KernelLinear(storage, bias, policy)


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
