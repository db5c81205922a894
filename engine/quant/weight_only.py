"""int8 and group-wise int4 weight-only quantization through torch's packed weight-only
kernels: weights are stored as integer codes with scales, activations stay in the load dtype,
and the kernel dequantizes inside the matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import packing
from engine.kernels.linear import KernelLinear
from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import Int4GroupWeight, Int8RowWeight
from engine.quant.base import M, QuantizationError, QuantScheme, missing_kernels, replace_linears

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INT8_OPS = ("_weight_int8pack_mm",)
INT4_CPU_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
INT4_CUDA_OPS = ("_convert_weight_to_int4pack", "_weight_int4pack_mm")
# 32 columns per scale/zero pair: the finest group the int4 kernels take. SmolLM2's hidden
# size (576) is not a multiple of 128, and coarser groups cost much more quality for 1/32 of a
# byte per weight saved. Measured on the packaged SmolLM2-135M (160 eval tokens): groups of 64
# give mean KL 0.35 and 66% top-1 agreement; groups of 32 give KL ~5e-8 and 100%, because that
# model was shipped as a Q4_1 GGUF (an fp16 scale and minimum per 32 input columns, 16 levels):
# g32 min/max lands on the same grid, and the weights read back through the kernel equal the
# loaded fp32 weights exactly in all 210 layers (checked; the KL left is float summation order).
DEFAULT_INT4_GROUP_SIZE = 32
# The CUDA kernel runs in bfloat16 only and tiles the input width by 16 * inner_k_tiles.
CUDA_INT4_DTYPE = torch.bfloat16
# torch's packed int4 layouts tile the output rows: by 16 on the CPU, by 8 on CUDA.
CPU_INT4_ROW_MULTIPLE, CUDA_INT4_ROW_MULTIPLE = 16, 8


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (codes * scale).T + b with int8 codes, one scale per output channel."""

    weight_int8: torch.Tensor  # buffers
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scales = packing.quantize_int8_per_row(linear.weight.detach())
        self.register_buffer("weight_int8", codes.contiguous())
        # the kernel wants the scales in the activation dtype
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        return packing.dequantize_int8_per_row(self.weight_int8, self.scales)


class Int4WeightOnlyLinear(nn.Module):
    """Group-wise asymmetric int4 weights in torch's packed (tinygemm) layout."""

    weight_int4: torch.Tensor  # buffers
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_INT4_GROUP_SIZE, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        weight = linear.weight.detach()
        if self.in_features % group_size:
            raise QuantizationError(
                f"int4-weight-only cannot quantize {name or 'a layer'}: its input width {self.in_features} "
                f"is not a multiple of the group size {group_size}."
            )
        self.on_cuda = weight.device.type == "cuda"
        rows = CUDA_INT4_ROW_MULTIPLE if self.on_cuda else CPU_INT4_ROW_MULTIPLE
        if self.out_features % rows:
            raise QuantizationError(
                f"int4-weight-only cannot quantize {name or 'a layer'}: its output width {self.out_features} "
                f"is not a multiple of {rows}, which torch's packed int4 layout needs."
            )
        codes, scales, zeros = packing.quantize_int4_groups(weight, group_size)
        if self.on_cuda:
            inner_k_tiles = _inner_k_tiles(self.in_features, name)
            packed = torch.ops.aten._convert_weight_to_int4pack(packing.pack_int4_pairs(codes), inner_k_tiles)
            self.compute_dtype = CUDA_INT4_DTYPE
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.compute_dtype = weight.dtype
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", packing.scales_and_zeros(scales, zeros, self.compute_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                flat, self.weight_int4, self.group_size, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.weight_int4, self.group_size, self.scales_and_zeros
            )
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        y = self._matmul(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel actually multiplies by, read back through the kernel itself
        (identity input), so a packing mistake shows up here rather than being re-derived."""
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.weight_int4.device)
        return self._matmul(eye).float().t()


def _inner_k_tiles(in_features: int, name: str) -> int:
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise QuantizationError(
        f"int4-weight-only on CUDA cannot quantize {name or 'a layer'}: its input width {in_features} "
        "is not a multiple of 32."
    )


class Int8WeightOnly(QuantScheme):
    name = "int8-weight-only"
    description = (
        "int8 weights with one scale per output channel; activations stay in the load dtype "
        "(torch _weight_int8pack_mm)"
    )

    def check(self, device: torch.device) -> tuple[bool, str]:
        problem = missing_kernels(INT8_OPS, device)
        if problem:
            return False, problem
        return True, f"torch.ops.aten._weight_int8pack_mm on {device.type}"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        def make(name: str, linear: nn.Linear) -> nn.Module:
            if linear.weight.device.type != "cpu":
                return Int8WeightOnlyLinear(linear)
            codes, scales = packing.quantize_int8_per_row(linear.weight.detach())
            return KernelLinear(Int8RowWeight(codes, scales), linear.bias, KernelPolicy())

        return replace_linears(model, make)


class Int4WeightOnly(QuantScheme):
    name = "int4-weight-only"

    def __init__(self, group_size: int = DEFAULT_INT4_GROUP_SIZE):
        self.group_size = group_size
        self.description = (
            f"int4 weights, asymmetric groups of {group_size} input columns (a scale and a zero per "
            "group); activations stay in the load dtype (torch _weight_int4pack_mm)"
        )

    def check(self, device: torch.device) -> tuple[bool, str]:
        if device.type == "cuda":
            problem = missing_kernels(INT4_CUDA_OPS, device)
            if problem:
                return False, problem
            if torch.cuda.get_device_capability(device) < (8, 0):
                return False, "torch's CUDA int4 kernel needs an Ampere (sm80) or newer GPU"
            return True, "torch.ops.aten._weight_int4pack_mm on cuda (computes in bfloat16)"
        problem = missing_kernels(INT4_CPU_OPS, device)
        if problem:
            return False, problem
        return True, f"torch.ops.aten._weight_int4pack_mm_for_cpu on {device.type}"

    def quantize(self, model: M, tokenizer: PreTrainedTokenizerBase | None = None) -> M:
        def make(name: str, linear: nn.Linear) -> nn.Module:
            if linear.weight.device.type != "cpu" or self.group_size != DEFAULT_INT4_GROUP_SIZE:
                return Int4WeightOnlyLinear(linear, self.group_size, name)
            if linear.in_features % self.group_size:
                raise QuantizationError(
                    f"int4-weight-only cannot quantize {name or 'a layer'}: its input width "
                    f"{linear.in_features} is not a multiple of the group size {self.group_size}."
                )
            codes, scales, zeros = packing.quantize_int4_groups(linear.weight.detach(), self.group_size)
            return KernelLinear(Int4GroupWeight(codes, scales, zeros), linear.bias, KernelPolicy())

        return replace_linears(model, make)


class DequantizingLayer(Protocol):
    """A quantized linear that can give back the weight its kernel multiplies by."""

    @property
    def bias(self) -> torch.Tensor | None: ...

    def dequantized_weight(self) -> torch.Tensor: ...


def reference_linear(x: torch.Tensor, layer: DequantizingLayer) -> torch.Tensor:
    """The layer's output recomputed from its dequantized weight in float32 (tests, debugging)."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantized_weight().float(), bias)
