"""fp8 (e4m3) weight storage with one scale per output channel, dequantized on the fly.

This halves (vs bf16) or quarters (vs fp32) the weight bytes; the matmul itself still runs in the
load dtype, because a true fp8 GEMM (torch._scaled_mm) needs an sm89+ GPU and fp8 activations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.base import M, QuantScheme, replace_linears

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite e4m3fn value


class Fp8WeightLinear(nn.Module):
    weight_fp8: torch.Tensor  # buffers
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        # Scale each row so its largest weight lands on the largest fp8 value: the row uses the
        # whole exponent range, and e4m3's 3 mantissa bits give ~6% worst-case relative rounding.
        scales = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        self.register_buffer("weight_fp8", (weight / scales[:, None]).to(FP8_DTYPE))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_fp8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


class Fp8Weight(QuantScheme):
    name = "fp8-e4m3"
    description = (
        "fp8 (e4m3) weights with one scale per output channel, dequantized to the load dtype "
        "for each matmul (storage saving, not a faster kernel)"
    )

    def check(self, device: torch.device) -> tuple[bool, str]:
        if FP8_DTYPE is None:
            return False, f"this PyTorch build ({torch.__version__}) has no float8_e4m3fn dtype"
        try:
            probe = torch.ones(2, device=device).to(FP8_DTYPE).to(torch.float32)
        except (RuntimeError, TypeError) as exc:
            return False, f"PyTorch cannot convert to float8_e4m3fn on {device.type} ({exc})"
        if probe.sum().item() != 2.0:
            return False, f"float8_e4m3fn conversion on {device.type} does not round-trip"
        return True, f"float8_e4m3fn storage on {device.type}, dequantized per matmul"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        return replace_linears(model, lambda name, linear: Fp8WeightLinear(linear))
