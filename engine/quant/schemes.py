"""The quantization schemes by name: what each needs, whether it runs here, and applying one.

Entry points for the loader, the CLI and the app's model picker:
  scheme_names()                 every scheme, in display order
  scheme_statuses(device)        [SchemeStatus(name, description, available, reason)]
  get_scheme(name)               the scheme object (QuantizationError for an unknown name)
  quantize_model(model, name, device, tokenizer)
                                 quantize in place; never falls back to another scheme
  quantization_of(model)         the QuantizedWeights record of a quantized model, or None
Only the decoder's linear layers are quantized; embeddings and the LM head keep the load dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels import native
from engine.quant.base import (
    M,
    QuantizationError,
    QuantScheme,
    missing_kernels,
    model_weight_bytes,
    target_linears,
)
from engine.quant.bnb import Bnb4bit, BnbInt8
from engine.quant.fp8 import Fp8Weight
from engine.quant.w8a8 import W8A8, W8A8SmoothQuant
from engine.quant.weight_only import Int4WeightOnly, Int8WeightOnly

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "NONE",
    "QuantizationError",
    "QuantizedWeights",
    "SchemeStatus",
    "check_scheme",
    "get_scheme",
    "quantization_of",
    "quantize_model",
    "scheme_names",
    "scheme_statuses",
]

NONE = "none"
# Set on a quantized model, like transformers' own `model.quantization_config`.
MODEL_ATTRIBUTE = "kvscope_quantization"


class FullPrecision(QuantScheme):
    name = NONE
    description = "full precision: weights stay in the load dtype (float32, bfloat16 or float16)"

    def check(self, device: torch.device) -> tuple[bool, str]:
        return True, f"plain matmuls on {device.type}"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        return model


class NativeGguf(QuantScheme):
    """Applied by the loader while it reads the file (engine/model/gguf_native.py), not to a
    loaded model: a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks kept as they are."""

    name = "native"
    description = (
        "a GGUF file's own blocks kept at their bits (F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) "
        "and multiplied by kvk's kernels, the kernel per row count measured; without kvk, Q4_0/Q4_1/Q4_K "
        "as torch's int4 groups and Q8_0 as its blocks (GGUF sources only)"
    )

    def check(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cpu":
            return False, "its packed kernels here are torch's CPU ones; on a GPU load the GGUF with 'none'"
        if native.kernels() is not None:
            return True, f"{native.status()}: every common GGUF type at its bits"
        problem = missing_kernels(("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"), device)
        if problem:
            return False, problem
        return True, f"slower path ({native.status()}): torch's packed int4/int8 CPU kernels"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        raise QuantizationError("'native' applies while a GGUF file is read; load the file with it instead.")


class Automatic(QuantScheme):
    """The default choice: resolved by the loader per source (engine.model.loading.resolve_scheme)."""

    name = "auto"
    description = "a GGUF file's own blocks ('native'); any other source in full precision ('none')"

    def check(self, device: torch.device) -> tuple[bool, str]:
        if device.type == "cpu":
            return True, "native for GGUF sources, none otherwise"
        return True, "none (a GGUF is dequantized on a GPU)"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        raise QuantizationError("'auto' is resolved when the model is loaded, from its source.")


_SCHEMES: tuple[QuantScheme, ...] = (
    Automatic(),
    FullPrecision(),
    NativeGguf(),
    BnbInt8(),
    Bnb4bit("nf4"),
    Bnb4bit("fp4"),
    Int8WeightOnly(),
    Int4WeightOnly(),
    Fp8Weight(),
    W8A8(),
    W8A8SmoothQuant(),
)
_BY_NAME = {s.name: s for s in _SCHEMES}


@dataclass(frozen=True, slots=True)
class SchemeStatus:
    name: str
    description: str
    available: bool
    reason: str  # how it runs when available, why not otherwise


@dataclass(frozen=True, slots=True)
class QuantizedWeights:
    """What quantizing did to a model: shown next to the model and in the memory graph."""

    scheme: str
    bytes_before: int  # parameters + buffers in the load dtype
    bytes_after: int  # the same after quantization (codes, scales, zeros, quantization state)
    quantized_layers: int  # decoder linears no longer plain nn.Linear after quantizing
    seconds: float


def scheme_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def get_scheme(name: str) -> QuantScheme:
    scheme = _BY_NAME.get(name)
    if scheme is None:
        raise QuantizationError(
            f"Unknown quantization scheme '{name}'. Choose one of: {', '.join(scheme_names())}."
        )
    return scheme


def scheme_statuses(device: torch.device | str) -> list[SchemeStatus]:
    statuses = []
    for scheme in _SCHEMES:
        ok, reason = scheme.available(device)
        statuses.append(SchemeStatus(scheme.name, scheme.description, ok, reason))
    return statuses


def check_scheme(name: str, device: torch.device | str) -> QuantScheme:
    """The scheme, or QuantizationError saying why it cannot run on `device` (cheap: no model)."""
    scheme = get_scheme(name)
    scheme.require(torch.device(device))
    return scheme


def quantize_model(model: M, name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
    """Quantize `model` in place with scheme `name` on the device it already lives on, record a
    QuantizedWeights on it and return it. 'none' returns the model untouched (and unrecorded)."""
    device = next(model.parameters()).device
    scheme = check_scheme(name, device)
    if name == NONE:
        return model
    already = quantization_of(model)
    if already is not None:
        raise QuantizationError(f"The model is already quantized ({already.scheme}).")
    before = model_weight_bytes(model)
    start = time.perf_counter()
    plain_before = len(target_linears(model))
    # no_grad, not inference_mode: inference tensors would refuse later in-place updates
    # (bitsandbytes moves and re-wraps its parameters).
    with torch.no_grad():
        model = scheme.quantize(model, tokenizer)
    # counted after the fact, so a layer a scheme left as a plain nn.Linear is not reported as done
    layers = plain_before - len(target_linears(model))
    record = QuantizedWeights(name, before, model_weight_bytes(model), layers, time.perf_counter() - start)
    setattr(model, MODEL_ATTRIBUTE, record)
    return model


def quantization_of(model: nn.Module) -> QuantizedWeights | None:
    return getattr(model, MODEL_ATTRIBUTE, None)
