"""bitsandbytes schemes: LLM.int8() and 4-bit NF4 / FP4 (QLoRA's formats). bitsandbytes
0.49+ ships CPU kernels as well as CUDA ones; the package is imported only when a model is
actually quantized (the import alone takes seconds)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.quant.base import M, QuantScheme, replace_linears

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# LLM.int8()'s outlier threshold: input columns with any |x| above it run in 16-bit.
INT8_OUTLIER_THRESHOLD = 6.0


def _bnb_status(device: torch.device) -> tuple[bool, str]:
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return False, "the 'bitsandbytes' package is not installed (pip install bitsandbytes)"
    version = importlib.metadata.version("bitsandbytes")
    if device.type == "cuda":
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        if not any(package_dir.glob("libbitsandbytes_cuda*")):
            return False, f"bitsandbytes {version} is installed without its CUDA library"
    return True, f"bitsandbytes {version} kernels on {device.type}"


def _load_dtype(linear: nn.Linear) -> torch.dtype:
    return linear.weight.dtype


class _DropFp16CastNotice(logging.Filter):
    """LLM.int8() logs a warning on every forward of every layer that its float32/bfloat16
    input is cast to float16 (its design, stated in the scheme's description); once per layer
    per token would flood the log, so that one message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MatMul8bitLt: inputs will be cast")


_CAST_NOTICE_FILTER = _DropFp16CastNotice()


class BnbInt8(QuantScheme):
    name = "bnb-int8"
    description = (
        "bitsandbytes LLM.int8(): int8 weights per row; activations cast to float16, then int8 per "
        f"token, with input columns holding outliers above {INT8_OUTLIER_THRESHOLD} kept in float16"
    )

    def check(self, device: torch.device) -> tuple[bool, str]:
        return _bnb_status(device)

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        # bitsandbytes: optional, slow to import, and only for its own schemes
        import bitsandbytes as bnb

        logging.getLogger("bitsandbytes.autograd._functions").addFilter(_CAST_NOTICE_FILTER)

        def make(name: str, linear: nn.Linear) -> nn.Module:
            device = linear.weight.device
            layer = bnb.nn.Linear8bitLt(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                has_fp16_weights=False,
                threshold=INT8_OUTLIER_THRESHOLD,
                device="cpu",
            )
            # Int8Params quantizes when moved from the CPU to the target device.
            layer.weight = bnb.nn.Int8Params(
                linear.weight.detach().cpu(), requires_grad=False, has_fp16_weights=False
            )
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.detach().cpu(), requires_grad=False)
            moved: nn.Module = layer.to(device)
            return moved

        return replace_linears(model, make)


class Bnb4bit(QuantScheme):
    def __init__(self, quant_type: str):
        self.quant_type = quant_type
        self.name = f"bnb-{quant_type}"
        grid = "NF4 (4-bit normal-float)" if quant_type == "nf4" else "FP4 (4-bit float)"
        self.description = (
            f"bitsandbytes {grid} weights in blocks of 64 with double-quantized scales; "
            "dequantized to the load dtype for each matmul"
        )

    def check(self, device: torch.device) -> tuple[bool, str]:
        return _bnb_status(device)

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        # bitsandbytes: optional, slow to import, and only for its own schemes
        import bitsandbytes as bnb

        def make(name: str, linear: nn.Linear) -> nn.Module:
            device = linear.weight.device
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=_load_dtype(linear),
                quant_type=self.quant_type,
                device="cpu",
            )
            # Params4bit quantizes when moved to a device (CPU included).
            layer.weight = bnb.nn.Params4bit(
                linear.weight.detach().cpu(), requires_grad=False, quant_type=self.quant_type
            )
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.detach().cpu(), requires_grad=False)
            moved: nn.Module = layer.to(device)
            return moved

        return replace_linears(model, make)
