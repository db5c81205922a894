"""`--quantization native`: a GGUF file's tensors kept as the file stores them, read with the
`gguf` package (no transformers conversion, no float32 copy of a quantized weight).

The file is memory-mapped and every quantized tensor stays a view of the mapping: the process
holds the file's pages, shared with the page cache, not a copy. The model's skeleton is built from
the file's metadata on the meta device; every tensor is then placed by the name map transformers
itself uses for GGUF:
  - with the kvk kernels (engine/kernels/native), every common type (F16, BF16, Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) is a GGUFWeight: linear layers multiply by its blocks,
    the embedding reads its rows exactly, the LM head computes every logit from it in float32;
  - without them (no build and no compiler: the slower path the load notes name), Q4_0, Q4_1 and
    Q4_K become torch's packed int4 layout (codes exact) and Q8_0 stays Q8_0 blocks;
  - a type no kernel keeps (IQ1/IQ2/IQ3, TQ) is dequantized to bfloat16, its memory cost said in
    the notes; float tensors (norms, biases) are loaded in the load dtype.
Row permutations transformers applies (llama.cpp stores Llama's q/k rows interleaved for its
RoPE) are the kernel's row map for a GGUFWeight, and applied to the rows of the torch layouts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels import native
from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import KernelHead, KernelLinear
from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import DenseWeight, Q8BlockWeight, WeightStorage
from engine.model import gguf_plan
from engine.model.configs import gguf_header, read_gguf_config
from engine.model.gguf_header import GGUFHeader

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

NATIVE = "native"


@dataclass(slots=True)
class NativeReport:
    """What native loading kept and what it had to dequantize, for the load message."""

    kept: Counter[str] = field(default_factory=Counter)  # GGUF type name -> tensors kept in it
    dequantized: Counter[str] = field(default_factory=Counter)  # GGUF type name -> tensors dequantized
    notes: list[str] = field(default_factory=list)
    dequantized_bytes: int = 0  # the bfloat16 copies of types no kernel keeps

    def summary(self) -> str:
        kept = ", ".join(f"{n} x{c}" for n, c in self.kept.most_common())
        text = f"kept at their own bits: {kept or 'nothing'}"
        lossy = {k: v for k, v in self.dequantized.items() if k not in ("F32", "F16", "BF16")}
        if lossy:
            text += "; dequantized to bfloat16 (no kernel keeps them): " + ", ".join(
                f"{n} x{c}" for n, c in lossy.items()
            )
            text += f" ({self.dequantized_bytes / 2**20:.0f} MiB)"
        return text


class QuantEmbedding(nn.Module):
    """An embedding lookup over quantized blocks: each row dequantized exactly (as gguf does) when
    looked up."""

    def __init__(
        self, storage: GGUFWeight | Q8BlockWeight, dtype: torch.dtype, padding_idx: int | None = None
    ):
        super().__init__()
        self.storage = storage
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = storage.out_features, storage.in_features
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.storage.rows(flat, self.dtype).reshape(*ids.shape, self.embedding_dim)


@dataclass(frozen=True, slots=True)
class MappedTensor:
    """A tensor of the file as gguf-py presents one: its name, type, GGUF shape ([cols, rows, ..]
    for a matrix) and data, a view of the file's mapping shaped as gguf-py shapes it (float types
    as their values [rows, cols]; quantized types and BF16 as bytes [rows, bytes per row])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def mapped_tensors(path: Path, header: GGUFHeader) -> list[MappedTensor]:
    """Every tensor of the file as a view of one copy-on-write mapping of it: nothing is read
    until a kernel touches it, nothing is copied, and torch may take the views as writable (the
    file is never written). The views keep the mapping alive for the model's life."""
    mapping = np.memmap(path, mode="c").view(np.ndarray)
    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    out = []
    for info in header.tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        dims = tuple(int(d) for d in info.dims)
        count = int(np.prod(dims)) if dims else 1
        start = header.data_start + info.offset
        if qtype in floats:
            dtype = np.dtype(floats[qtype])
            data = mapping[start : start + count * dtype.itemsize].view(dtype).reshape(tuple(reversed(dims)))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            shape = (*reversed(dims[1:]), dims[0] // block * size)
            data = mapping[start : start + count // block * size].reshape(shape)
        out.append(MappedTensor(info.name, qtype, dims, data))
    return out


def load_native(
    path: Path, dtype: torch.dtype, policy: KernelPolicy, report: Callable[[str, float], None]
) -> tuple[PreTrainedModel, NativeReport]:
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = read_gguf_config(path)  # the lean header, its tensors' extents checked
    header = gguf_header(path)
    arch = str(header.fields["general.architecture"])
    tensors = mapped_tensors(path, header)
    model: PreTrainedModel
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor_class: type[TensorProcessor] = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_class(config=config.to_dict())
    names = _name_map(model, arch, tensors)
    if names is None:  # transformers' own (slower, recursive) mapping handles the unusual layouts
        try:
            names = get_gguf_hf_weights_map(model, processor)
        except (NotImplementedError, ImportError) as exc:
            raise ModelLoadError(
                f"{path.name}: its tensors cannot be mapped onto the model ({exc})."
            ) from None
    kvk = native.kernels()
    result = NativeReport()
    result.notes.append(
        f"GGUF kernels: {native.status()}" if kvk is not None else f"slower path: {native.status()}"
    )
    embedding_storage: WeightStorage | None = None
    for i, tensor in enumerate(tensors):
        if i % 16 == 0:
            report(f"reading {path.name} at its own bits", 0.4 + 0.4 * i / len(tensors))
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        module_name, _, attr = hf_name.rpartition(".")
        module = model.get_submodule(module_name)
        qtype = tensor.tensor_type
        cols = int(tensor.shape[0])  # GGUF shapes are [cols, rows]
        matrix = attr == "weight" and len(tensor.shape) == 2
        if matrix and type(module) is nn.Linear:
            order = _row_order(processor, tensor.name, int(tensor.shape[1]))
            storage = _kept_storage(tensor, qtype, cols, order, kvk)
            if storage is not None:
                # the bias (a dense tensor) may come before or after: keep what is there, even a meta
                # placeholder that a later tensor replaces (a placeholder left at the end is an error)
                _set_module(model, module_name, KernelLinear(storage, module.bias, policy))
                result.kept[qtype.name] += 1
                continue
            if qtype not in _FLOAT_TYPES:  # no kernel keeps it: bfloat16, never float32
                weight = _dequantized(tensor, processor, getattr(torch, gguf_plan.DEQUANTIZED_LINEAR), module)
                _set_module(model, module_name, KernelLinear(DenseWeight(weight), module.bias, policy))
                result.dequantized[qtype.name] += 1
                result.dequantized_bytes += weight.numel() * 2
                continue
        if matrix and isinstance(module, nn.Embedding):
            storage = _kept_storage(tensor, qtype, cols, None, kvk, gguf_plan.EMBEDDING)
            if isinstance(storage, (GGUFWeight, Q8BlockWeight)):  # the types whose rows it can read
                _set_module(model, module_name, QuantEmbedding(storage, dtype, module.padding_idx))
                embedding_storage = storage
                result.kept[qtype.name] += 1
                continue
        if qtype not in _FLOAT_TYPES:
            result.dequantized_bytes += int(np.prod(tensor.shape)) * dtype.itemsize
        _assign_dense(model, module, attr, hf_name, tensor, processor, dtype)
        result.dequantized[qtype.name] += 1
    _tie_head(model, embedding_storage, policy)
    head = model.get_output_embeddings()
    if isinstance(head, KernelHead) and isinstance(head.storage, GGUFWeight):
        result.notes.append(
            f"LM head: every logit computed in float32 from the file's {head.storage.ggml_type.name} weights "
            "(no activation rounding, no second copy)"
        )
    _materialize_rest(model, config, dtype)
    return model.eval(), result


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _kept_storage(
    tensor: MappedTensor,
    qtype: GGMLQuantizationType,
    cols: int,
    order: np.ndarray | None,
    kvk: native.Kvk | None,
    role: str = gguf_plan.LINEAR,
) -> WeightStorage | None:
    """The tensor at its own bits, or None when no kernel here keeps its type in `role`: the
    decision of engine/model/gguf_plan.py, the table every fit estimate counts with too."""
    keeping = gguf_plan.keeping_for(qtype, role, kvk)
    return None if keeping is None else keeping.build(np.asarray(tensor.data), qtype, cols, order, kvk)


def _dequantized(
    tensor: MappedTensor, processor: TensorProcessor, dtype: torch.dtype, module: nn.Module
) -> torch.Tensor:
    """A tensor no kernel keeps, dequantized by gguf and processed as transformers does."""
    from gguf.quants import dequantize  # gguf's dequantizers: only for a type no kernel keeps

    weights = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    weights = processor.process(
        weights=weights, name=tensor.name, tensor_key_mapping={}, parsed_parameters={}
    ).weights
    value = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).to(dtype)
    current = getattr(module, "weight", None)
    if current is not None and tuple(current.shape) != tuple(value.shape):
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} has shape {tuple(value.shape)} where the model expects "
            f"{tuple(current.shape)}: the file does not match its own metadata."
        )
    return value


def _name_map(model: PreTrainedModel, arch: str, tensors: list[MappedTensor]) -> dict[str, str] | None:
    """GGUF tensor name -> the model's parameter name, with one gguf-py name table (transformers
    builds one per submodule); None when some tensor of the file is left unmapped."""
    # gguf: only once a GGUF file is read
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    archs = [key for key, value in MODEL_ARCH_NAMES.items() if value == arch]
    if not archs:
        return None
    table = get_tensor_name_map(archs[0], model.config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        base, dot, suffix = hf_name.rpartition(".")
        gguf = table.get_name(base)
        if gguf is None and "." in base:  # the task head's prefix ("model.") may not be in the table
            gguf = table.get_name(base.split(".", 1)[1])
        if gguf is not None:
            names[f"{gguf}{dot}{suffix}"] = hf_name
    if any(t.name not in names for t in tensors if not t.name.startswith("rope_")):
        return None
    return names


def _row_order(processor: TensorProcessor, name: str, rows: int) -> np.ndarray | None:
    """The row permutation the processor applies to this tensor, found by running it on the row
    numbers; None when it leaves rows alone. A processor that changes values is refused here
    (such tensors are not linear weights kvscope keeps)."""
    probe = np.arange(rows, dtype=np.float32)[:, None]
    out = processor.process(weights=probe, name=name, tensor_key_mapping={}, parsed_parameters={})
    order = np.asarray(out.weights).reshape(-1)
    if np.array_equal(order, probe.reshape(-1)):
        return None
    if not np.array_equal(np.sort(order), probe.reshape(-1)):
        raise ModelLoadError(f"{name}: its GGUF processing changes values, which native loading cannot keep.")
    return order.astype(np.int64)


def _assign_dense(
    model: nn.Module,
    module: nn.Module,
    attr: str,
    hf_name: str,
    tensor: MappedTensor,
    processor: TensorProcessor,
    dtype: torch.dtype,
) -> None:
    # gguf: only once a GGUF file is read
    from gguf.quants import dequantize

    weights = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    weights = processor.process(
        weights=weights, name=tensor.name, tensor_key_mapping={}, parsed_parameters={}
    ).weights
    value = torch.from_numpy(np.array(weights, dtype=np.float32)).to(dtype)  # a writable copy
    current = getattr(module, attr, None)
    if current is not None and tuple(current.shape) != tuple(value.shape):
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} has shape {tuple(value.shape)} where the model expects "
            f"{tuple(current.shape)} ({hf_name}): the file does not match its own metadata."
        )
    setattr(module, attr, nn.Parameter(value, requires_grad=False))


def _tie_head(model: PreTrainedModel, embedding_storage: WeightStorage | None, policy: KernelPolicy) -> None:
    """The LM head over the file's output tensor, or over the embedding it is tied to (one copy)."""
    head = model.get_output_embeddings()
    if isinstance(head, KernelLinear):  # the file has its own output weights
        model.lm_head = KernelHead(head.storage, head.bias, policy)
        return
    if embedding_storage is not None:
        model.lm_head = KernelHead(embedding_storage, None, policy)
        return
    embed = model.get_input_embeddings()
    if isinstance(head, nn.Linear) and head.weight.is_meta:
        weight = embed.weight
        assert isinstance(weight, torch.Tensor), "an input embedding holds its table as a weight"
        model.lm_head = KernelHead(DenseWeight(weight, relayout=False), None, policy)  # tied: one tensor


def _materialize_rest(model: PreTrainedModel, config: PreTrainedConfig, dtype: torch.dtype) -> None:
    """Buffers computed at construction (rotary frequencies) were made on the meta device: build
    those modules again for real; any parameter still on meta means the file lacks a tensor."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            _set_module(model, name, type(module)(config=config))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(
            f"the GGUF file has no tensor for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
            "it is incomplete or from an unsupported converter."
        )
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            raise ModelLoadError(
                f"native GGUF loading cannot build {name} for this architecture; use --quantization none."
            )


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
