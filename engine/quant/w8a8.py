"""W8A8: int8 weights (per output channel) times int8 activations quantized per token at run
time, accumulated in int32 by torch._int_mm; optionally SmoothQuant-smoothed (see smoothquant.py).

Unlike weight-only schemes, the activations lose precision too: an activation channel with a
large outlier stretches its token's int8 grid and crushes every other channel of that token,
which is exactly the failure SmoothQuant was invented to fix."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels import packing
from engine.quant.base import M, QuantizationError, QuantScheme, has_aten_kernel, replace_linears
from engine.quant.smoothquant import calibrate_input_absmax, smoothing_factors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# torch._int_mm's CUDA kernel refuses fewer than 17 rows; a decode step has one per sequence.
CUDA_INT_MM_MIN_ROWS = 17


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], float32 scales [M]), symmetric per row (token)."""
    scales = (x.abs().amax(dim=1).float() / packing.INT8_MAX).clamp(min=packing.MIN_SCALE)
    codes = torch.round(x.float() / scales[:, None]).clamp(-packing.INT8_MAX, packing.INT8_MAX)
    return codes.to(torch.int8), scales


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """a [M, K] int8 @ b_t [K, N] int8 -> exact int32-valued products, as float32 [M, N].

    Without an int8 kernel the reference path multiplies the same int8 values in float64,
    whose 53-bit mantissa holds every such dot product exactly (|sum| < K * 127^2)."""
    if not use_int_mm:
        return (a.double() @ b_t.double()).float()
    rows = a.shape[0]
    if a.is_cuda and rows < CUDA_INT_MM_MIN_ROWS:
        a = torch.cat([a, a.new_zeros(CUDA_INT_MM_MIN_ROWS - rows, a.shape[1])])
    return torch._int_mm(a, b_t)[:rows].float()


@functools.cache
def _int_mm_exact(device_type: str) -> bool:
    """Whether torch._int_mm gives the exact products here, probed once per device type with
    codes near +-127 (where a 16-bit intermediate would saturate). On a CPU with AVX-512 but
    no VNNI, oneDNN's int8 GEMM sums pairs of products in saturating 16-bit lanes (measured,
    oneDNN capped at AVX512_CORE: 1e4 where 2e4 was right), so the int8 figures would be wrong."""
    device = torch.device(device_type)
    if not has_aten_kernel("_int_mm", device):
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randint(100, 128, (32, 256), generator=g, dtype=torch.int8) * torch.randint(
        0, 2, (32, 256), generator=g, dtype=torch.int8
    ).mul(2).sub(1)
    b = torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8)
    exact = (a.long() @ b.long().t()).float()
    try:
        got = int8_matmul(a.to(device), b.t().to(device), use_int_mm=True).cpu()
    except RuntimeError:
        return False
    return bool(torch.equal(got, exact))


def int_mm_usable(device: torch.device) -> bool:
    """torch._int_mm has a kernel for the device and it multiplies exactly (_int_mm_exact)."""
    return _int_mm_exact(device.type)


class W8A8Linear(nn.Module):
    weight_int8: torch.Tensor  # buffers
    weight_scales: torch.Tensor
    inv_smoothing: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, smoothing: torch.Tensor | None = None):
        """`smoothing` (per input channel, > 0) migrates activation range into the weights:
        the weight columns are multiplied by it before quantization and each activation is
        divided by it right before its own quantization, so the product is unchanged."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        if smoothing is not None:
            weight = weight * smoothing.float()[None, :]
        codes, scales = packing.quantize_int8_per_row(weight)
        self.register_buffer("weight_int8", codes)
        self.register_buffer("weight_scales", scales)
        inv = None if smoothing is None else (1.0 / smoothing.float()).to(linear.weight.dtype)
        self.register_buffer("inv_smoothing", inv)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.use_int_mm = int_mm_usable(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.inv_smoothing is not None:
            flat = flat * self.inv_smoothing
        codes, act_scales = quantize_activations_per_token(flat)
        acc = int8_matmul(codes, self.weight_int8.t(), self.use_int_mm)
        y = (acc * act_scales[:, None] * self.weight_scales[None, :]).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _int_mm_status(device: torch.device) -> tuple[bool, str]:
    if int_mm_usable(device):
        return True, f"torch._int_mm (int8 x int8 -> int32) on {device.type}"
    if has_aten_kernel("_int_mm", device):
        return True, (
            f"reference path: torch._int_mm on this {device.type} does not give exact int8 products "
            "(without AVX-512 VNNI oneDNN saturates 16-bit sums), so they are computed exactly in "
            "float64 (correct figures, slow)"
        )
    return True, (
        f"reference path: this PyTorch build has no {device.type} kernel for torch._int_mm, so the int8 "
        "products are computed exactly in float64 (correct figures, slow)"
    )


class W8A8(QuantScheme):
    name = "w8a8"
    description = (
        "int8 weights per output channel and int8 activations quantized per token at run time, "
        "int32 accumulation (torch._int_mm)"
    )

    def check(self, device: torch.device) -> tuple[bool, str]:
        return _int_mm_status(device)

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        return replace_linears(model, lambda name, linear: W8A8Linear(linear))


class W8A8SmoothQuant(QuantScheme):
    name = "w8a8-smoothquant"

    def __init__(self, alpha: float = 0.5):
        self.alpha = alpha
        self.description = (
            f"W8A8 with SmoothQuant: per-channel scales (alpha {alpha}) calibrated on a few built-in "
            "prompts move activation outliers into the weights before both are quantized"
        )

    def check(self, device: torch.device) -> tuple[bool, str]:
        return _int_mm_status(device)

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        if tokenizer is None:
            raise QuantizationError(
                "w8a8-smoothquant calibrates on sample prompts and needs the model's tokenizer."
            )
        absmax = calibrate_input_absmax(model, tokenizer)

        def make(name: str, linear: nn.Linear) -> nn.Module:
            return W8A8Linear(linear, smoothing_factors(absmax[name], linear.weight, self.alpha))

        return replace_linears(model, make)
