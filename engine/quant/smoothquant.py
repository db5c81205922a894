"""SmoothQuant calibration: per-input-channel activation ranges from a few prompts, and the
smoothing factors s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) that balance them against the
weights (Xiao et al., 2023). alpha 0.5 splits the difficulty evenly between the two.

kvscope applies s as a multiply on each linear's input (see W8A8Linear) rather than folding it
into the preceding RMSNorm: o_proj and down_proj have no norm in front of them, and their inputs
carry the largest outliers, so every linear is smoothed the same explicit way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.quant.base import target_linears
from engine.text.chat_template import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Varied, everyday requests (not the evaluation text, which would flatter the figures).
CALIBRATION_PROMPTS = (
    "Write a short note inviting my neighbours to a garden party on Saturday afternoon.",
    "What is the difference between a virus and a bacterium? Explain it simply.",
    "List five ways to save water at home, with one sentence on each.",
    "Translate into French: The train to the coast leaves at seven in the morning.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number iteratively",
    "Summarise the plot of a detective story in which the gardener is innocent.",
)
# The smallest factor allowed: a channel that never fired would otherwise get s = 0.
MIN_FACTOR = 1e-5


@torch.no_grad()
def calibrate_input_absmax(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: tuple[str, ...] = CALIBRATION_PROMPTS
) -> dict[str, torch.Tensor]:
    """Per target linear, the largest |activation| seen on each input channel over `prompts`
    (each wrapped in the model's chat template, as the engine will feed it)."""
    absmax: dict[str, torch.Tensor] = {}

    def hook_for(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], object], None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
            seen = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

        return hook

    handles = [m.register_forward_hook(hook_for(name)) for name, m in target_linears(model)]
    device = next(model.parameters()).device
    try:
        for prompt in prompts:
            # as the engine renders a chat (a model without a template gets plain text)
            rendered = render_chat(tokenizer, [{"role": "user", "content": prompt}])
            model(input_ids=torch.tensor([rendered.ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    return absmax


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] for a linear with weight [N, K] whose inputs reached `act_absmax` [K]."""
    w_absmax = weight.detach().abs().amax(dim=0).float().clamp(min=MIN_FACTOR)
    a = act_absmax.to(w_absmax.device).clamp(min=MIN_FACTOR)
    return (a.pow(alpha) / w_absmax.pow(1.0 - alpha)).clamp(min=MIN_FACTOR)
