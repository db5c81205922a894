"""What every scheme shares: the scheme interface, the error it raises, which layers get
quantized, kernel availability probes and the byte count of a (possibly quantized) model."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from engine.config import ConfigError
from engine.kernels.linear import FusedProjection, KernelLinear

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# A model quantized in place comes back as itself: the same object, its type kept.
M = TypeVar("M", bound=nn.Module)


class QuantizationError(ConfigError):
    """A scheme is unknown or cannot run here; the message names the scheme and why."""


class QuantScheme:
    """One way of storing (and computing with) the decoder's linear layers.

    `quantize` replaces the model's linear layers in place and returns the model (gpt-fast's
    handler style). Embeddings and the LM head stay in the load dtype: they are a lookup and
    the final projection whose errors land directly on the output distribution, and on small
    models with tied embeddings they are one shared tensor."""

    name: str = ""
    description: str = ""

    def available(self, device: torch.device | str) -> tuple[bool, str]:
        """(True, how it runs) or (False, why not) on `device`."""
        device = torch.device(device)
        problem = device_problem(device)
        if problem:
            return False, problem
        return self.check(device)

    def check(self, device: torch.device) -> tuple[bool, str]:
        """The scheme's own requirements on a usable device (kernels, packages, dtypes)."""
        raise NotImplementedError

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        raise NotImplementedError

    def require(self, device: torch.device) -> None:
        ok, reason = self.available(device)
        if not ok:
            raise QuantizationError(f"The quantization scheme '{self.name}' is unavailable: {reason}.")


def device_problem(device: torch.device) -> str | None:
    """Why `device` itself cannot be used, or None."""
    if device.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            return "the GPU (cuda) is not usable: this PyTorch build has no CUDA support"
        return "the GPU (cuda) is not usable: PyTorch finds no NVIDIA GPU or driver"
    if device.type not in ("cpu", "cuda"):
        return f"kvscope runs models on cpu or cuda, not {device.type}"
    return None


def dispatch_key(device: torch.device) -> str:
    return {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}.get(device.type, device.type.upper())


def has_aten_kernel(op: str, device: torch.device) -> bool:
    """Whether this torch build has a kernel for `aten::op` on the device's backend (a
    registered op without a kernel for the device would fail only at the first forward)."""
    return hasattr(torch.ops.aten, op) and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"aten::{op}", dispatch_key(device)
    )


def missing_kernels(ops: tuple[str, ...], device: torch.device) -> str | None:
    """None when every op has a kernel for the device, else the reason sentence."""
    missing = [op for op in ops if not has_aten_kernel(op, device)]
    if not missing:
        return None
    names = ", ".join(f"torch.ops.aten.{op}" for op in missing)
    return f"this PyTorch build ({torch.__version__}) has no {device.type} kernel for {names}"


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's LM head, for a transformers model (others have none)."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if get_head is not None else None


def target_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder's linear layers: every nn.Linear except the output embedding (LM head)."""
    head = output_embeddings(model)
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m is not head]


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module acting as one of the decoder's linear layers, by the model's own names, in any
    format: plain, kernel (engine.kernels), a slice of a fused projection, a scheme's own layer.
    The LM head and the fused wholes are left out (their slices stand for them)."""

    head = output_embeddings(model)
    inside_fused = {id(m.linear) for m in model.modules() if isinstance(m, FusedProjection)}
    out = []
    for name, module in model.named_modules():
        if module is head or isinstance(module, FusedProjection) or id(module) in inside_fused:
            continue
        if isinstance(module, (nn.Linear, KernelLinear)) or (
            hasattr(module, "in_features") and hasattr(module, "out_features") and not list(module.children())
        ):
            out.append((name, module))
    return out


def quantized_layer_count(model: nn.Module) -> int:
    """Decoder linears not held in a dense float format (a fused projection counts its parts)."""
    count = 0
    for _, module in decoder_linears(model):
        fused = getattr(module, "fused", None)
        storage = getattr(fused.linear if fused is not None else module, "storage", None)
        kind = getattr(storage, "kind", None)
        if kind is None:
            count += type(module) is not nn.Linear
        else:
            count += not kind.startswith("dense")
    return count


def replace_linears(model: M, make: Callable[[str, nn.Linear], nn.Module]) -> M:
    """Swap each target linear for `make(name, linear)`, in place; the old weights are freed."""
    targets = target_linears(model)
    if not targets:
        raise QuantizationError("The model has no linear layers to quantize.")
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(name, linear))
    return model


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the weights occupy: parameters, buffers, the storages of kernel layers (packed codes
    and scales), bitsandbytes' quantization state, which hangs off its parameters. A tensor
    reachable twice (a tied embedding and LM head) counts once."""

    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.device.type == "meta":
            return
        key = _tensor_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    for module in model.modules():
        storages = (
            module.storages() if isinstance(module, KernelLinear) else (getattr(module, "storage", None),)
        )
        for storage in storages:
            if storage is not None and hasattr(storage, "tensors"):
                for t in storage.tensors():
                    add(t)
    for p in model.parameters():
        total += _bnb_state_bytes(p)
    return total


def _tensor_key(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's bytes live, so that two views of them count once. An opaque tensor (a
    oneDNN-packed weight) has no storage to point at: it is its own."""
    if t.is_mkldnn:
        return (id(t), 0)
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()))


def model_param_count(model: nn.Module) -> int:
    """Logical parameters: every weight once, whether a Parameter or held by a kernel layer's
    storage in a packed format (counted as out x in), tied tensors once."""
    seen_tensors: set[int] = set()
    seen_storages: set[int] = set()
    count = 0
    for p in model.parameters():
        if p.untyped_storage().data_ptr() not in seen_tensors or p.device.type == "meta":
            seen_tensors.add(p.untyped_storage().data_ptr())
            count += p.numel()
    for module in model.modules():
        storage = getattr(module, "storage", None)
        if storage is None or not hasattr(storage, "tensors") or id(storage) in seen_storages:
            continue
        seen_storages.add(id(storage))
        tensors = storage.tensors()
        if len(tensors) == 1 and _tensor_key(tensors[0])[0] in seen_tensors:
            continue  # a dense layer sharing a parameter (tied LM head)
        count += storage.out_features * storage.in_features
    return count


def _bnb_state_bytes(param: torch.Tensor) -> int:
    tensors = []
    scb = getattr(param, "SCB", None)  # LLM.int8: one absmax per output row
    if isinstance(scb, torch.Tensor):
        tensors.append(scb)
    state = getattr(param, "quant_state", None)  # 4-bit: block absmaxes, possibly quantized again
    while state is not None:
        tensors += [
            t for t in (getattr(state, "absmax", None), getattr(state, "code", None)) if t is not None
        ]
        state = getattr(state, "state2", None)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
