"""`--quantization native`: a GGUF file's quantized blocks kept as they are, read with the `gguf`
package (no transformers conversion, no float32 copy of the weights).

The model's skeleton is built from the file's metadata on the meta device; every tensor is then
placed by the name map transformers itself uses for GGUF: Q4_0, Q4_1 and Q4_K linear weights
become int4 group weights with their codes exact, Q8_0 stays Q8_0 blocks (the embedding reads its
rows exactly from them, a tied LM head multiplies by them), and any other tensor type is
dequantized to the load dtype, with a note naming it. Row permutations transformers applies
(llama.cpp stores Llama's q/k rows interleaved for its RoPE) are applied to the quantized rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.kernels.linear import REFINED_CANDIDATES, KernelHead, KernelLinear
from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import DenseWeight, Q8BlockWeight, WeightStorage
from engine.model import gguf_plan
from engine.model.configs import open_gguf, read_gguf_config
from engine.model.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

NATIVE = "native"


@dataclass(slots=True)
class NativeReport:
    """What native loading kept and what it had to dequantize, for the load message."""

    kept: Counter[str] = field(default_factory=Counter)  # GGUF type name -> tensors kept in it
    dequantized: Counter[str] = field(default_factory=Counter)  # GGUF type name -> tensors dequantized
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kept = ", ".join(f"{n} x{c}" for n, c in self.kept.most_common())
        text = f"kept at their own bits: {kept or 'nothing'}"
        lossy = {k: v for k, v in self.dequantized.items() if k not in ("F32", "F16", "BF16")}
        if lossy:
            text += "; dequantized (no kernel keeps them): " + ", ".join(
                f"{n} x{c}" for n, c in lossy.items()
            )
        return text


class QuantEmbedding(nn.Module):
    """An embedding lookup over kept blocks (Q8_0): each row dequantized exactly when looked up."""

    def __init__(self, storage: WeightStorage, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.storage = storage
        # a storage gguf_plan keeps in the embedding role reads rows exactly (Q8BlockWeight.rows)
        self._rows: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = getattr(storage, "rows")  # noqa: B009
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = storage.out_features, storage.in_features
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._rows(flat, self.dtype).reshape(*ids.shape, self.embedding_dim)


def load_native(
    path: Path, dtype: torch.dtype, policy: KernelPolicy, report: Callable[[str, float], None]
) -> tuple[PreTrainedModel, NativeReport]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = open_gguf(path)
    config = read_gguf_config(path)
    arch = str(reader.fields["general.architecture"].contents())
    model: PreTrainedModel
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor_class: type[TensorProcessor] = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_class(config=config.to_dict())
    names = _name_map(model, arch, reader)
    if names is None:  # transformers' own (slower, recursive) mapping handles the unusual layouts
        try:
            names = get_gguf_hf_weights_map(model, processor)
        except (NotImplementedError, ImportError) as exc:
            raise ModelLoadError(
                f"{path.name}: its tensors cannot be mapped onto the model ({exc})."
            ) from None
    result = NativeReport()
    dtype_name = str(dtype).removeprefix("torch.")
    tensors = list(reader.tensors)
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
        # what to hold: the one table every fit estimate reads too (engine/model/gguf_plan.py)
        role = _role(module, attr)
        shape = tuple(int(d) for d in reversed(list(tensor.shape)))
        keeping = gguf_plan.holding(qtype, role, shape, dtype_name).keeping
        if keeping is not None and role == gguf_plan.LINEAR:
            assert isinstance(module, nn.Linear), "the linear role is an nn.Linear's weight"
            order = _row_order(processor, tensor.name, int(tensor.shape[1]))
            storage = keeping.build(np.asarray(tensor.data), qtype, cols, order)
            # the bias (a dense tensor) may come before or after: keep what is there, even a meta
            # placeholder that a later tensor replaces (a placeholder left at the end is an error)
            _set_module(model, module_name, KernelLinear(storage, module.bias, policy))
            result.kept[qtype.name] += 1
            continue
        if keeping is not None and role == gguf_plan.EMBEDDING:
            assert isinstance(module, nn.Embedding), "the embedding role is an nn.Embedding's weight"
            storage = keeping.build(np.asarray(tensor.data), qtype, cols, None)
            _set_module(model, module_name, QuantEmbedding(storage, dtype, module.padding_idx))
            embedding_storage = storage
            result.kept[qtype.name] += 1
            continue
        _assign_dense(model, module, attr, hf_name, tensor, processor, dtype)
        result.dequantized[qtype.name] += 1
    _tie_head(model, config, embedding_storage, policy)
    head = model.get_output_embeddings()
    if isinstance(head, KernelHead) and head.scout is not None:
        result.notes.append(
            f"LM head: the pass over the vocabulary on a per-row int8 copy ({head.scout.nbytes / 2**20:.0f} MiB, "
            f"faster than the Q8_0 blocks' per-block kernel), its top {REFINED_CANDIDATES} recomputed from the blocks"
        )
    _materialize_rest(model, config, dtype)
    return model.eval(), result


def _name_map(model: PreTrainedModel, arch: str, reader: GGUFReader) -> dict[str, str] | None:
    """GGUF tensor name -> the model's parameter name, with one gguf-py name table (transformers
    builds one per submodule); None when some tensor of the file is left unmapped."""
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
    if any(t.name not in names for t in reader.tensors if not t.name.startswith("rope_")):
        return None
    return names


def _role(module: nn.Module, attr: str) -> str:
    """The tensor's role for gguf_plan: a linear layer's or the embedding's weight, or other."""
    if attr == "weight" and type(module) is nn.Linear:
        return gguf_plan.LINEAR
    if attr == "weight" and isinstance(module, nn.Embedding):
        return gguf_plan.EMBEDDING
    return gguf_plan.OTHER


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
    tensor: ReaderTensor,
    processor: TensorProcessor,
    dtype: torch.dtype,
) -> None:
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


def _tie_head(
    model: PreTrainedModel,
    config: PreTrainedConfig,
    embedding_storage: WeightStorage | None,
    policy: KernelPolicy,
) -> None:
    head = model.get_output_embeddings()
    if isinstance(head, KernelLinear):  # the file has its own output weights
        model.lm_head = KernelHead(head.storage, head.bias, policy, _scout(head.storage))
        return
    if embedding_storage is not None:
        model.lm_head = KernelHead(embedding_storage, None, policy, _scout(embedding_storage))
        return
    embed = model.get_input_embeddings()
    if isinstance(head, nn.Linear) and head.weight.is_meta:
        weight = embed.weight
        assert isinstance(weight, torch.Tensor), "an input embedding holds its table as a weight"
        model.lm_head = KernelHead(DenseWeight(weight, relayout=False), None, policy)  # tied: one tensor


def _scout(storage: WeightStorage) -> WeightStorage | None:
    """A Q8_0 head's full-vocabulary pass runs on a per-row int8 copy (see KernelHead and
    gguf_plan.HEAD_COPIES); the blocks stay the exact weights (the embedding's rows, the
    recomputed top candidates)."""
    if gguf_plan.makes_head_copy(storage.kind) and isinstance(storage, Q8BlockWeight):
        return storage.per_row_int8()
    return None


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
