"""The price of verifying drafts: a step that verifies k drafts against a plain decode step, on
the same model, at the same context, interleaved step by step (`engine bench --speculation`).

Two engines share the loaded model. Each runs one greedy request on the same synthetic prompt;
one decodes plainly, the other gets k drafts every step from a proposer whose drafts the target
rejects (a token it does not choose), so every step verifies exactly k drafts and both contexts
grow by one token a step. Their steps alternate (plain, verify, verify, plain, ...): a burst of
load elsewhere slows both. Reported: the median step (scheduling, forward, verification,
rollback, events; drafting apart), its forward and its postprocess, and their ratios; and, on a
second instrumented pass, where the forward's time goes in each (the linears, the LM head, the
attention, the rest), to show what a verification row costs and where.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from engine.bench.decode_split import FusedClock, _Clock
from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import Event, StepStats
from engine.kernels.linear import KernelHead, KernelLinear, panel_storages
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.speculative.proposers import Drafts, Sequence

if TYPE_CHECKING:
    import torch

import engine.model.llama_forward as forward_module  # isort: skip (patched by the split)
import engine.model.paged_attention as attention_module  # isort: skip


class RejectedDrafts:
    """Proposes k copies of one token the target never picks here (the last id of its head), so
    every round verifies k drafts and keeps none."""

    name = "rejected"
    free = True
    forwards = 1
    reads_hidden = False
    middle_layer = 0

    def __init__(self, token: int):
        self.token = token

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        return [([self.token] * k, [None] * k) for k in ks]

    def evidence(self, seq: Sequence) -> int:
        return 1  # always something to propose

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        pass

    def observe_hidden(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, length: int
    ) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def memory_bytes(self) -> tuple[int, int]:
        return 0, 0


def _engines(
    loaded: LoadedModel, k: int, context: int, steps: int
) -> tuple[LLMEngine, LLMEngine, dict[str, list[StepStats]]]:
    sinks: dict[str, list[StepStats]] = {"plain": [], "verify": []}

    def sink(name: str) -> Any:
        def take(event: Event) -> None:
            if isinstance(event, StepStats) and event.decode_tokens and not event.prefill_tokens:
                sinks[name].append(event)

        return take

    vocab = loaded.info.vocab_size
    prompt = tuple((1000 + i * 7919) % vocab for i in range(context))
    params = SamplingParams(temperature=0.0, max_new_tokens=2 * steps + 8, ignore_eos=True)
    plain = LLMEngine(loaded, EngineConfig(), sink("plain"))
    spec = SpeculativeConfig("ngram", num_draft=k, adaptive=False)
    verify = LLMEngine(loaded, EngineConfig(speculative=spec), sink("verify"))
    verify.proposer = RejectedDrafts(vocab - 1)
    for engine in (plain, verify):
        engine.add_request(Request(prompt_token_ids=prompt, sampling=params))
        for _ in range(64):  # up to the point where it decodes (prefilled, two tokens out)
            engine.step()
            if next(iter(engine.seqs.values())).num_output_tokens >= 2:
                break
    return plain, verify, sinks


def _step_ms(stats: list[StepStats]) -> dict[str, float]:
    return {
        "step_ms": statistics.median(s.duration_s - s.draft_s for s in stats) * 1e3,
        "forward_ms": statistics.median(s.forward_s for s in stats) * 1e3,
        "postprocess_ms": statistics.median(s.sample_s for s in stats) * 1e3,
    }


def verify_step_cost(loaded: LoadedModel, k: int = 4, context: int = 128, steps: int = 12) -> dict[str, Any]:
    """The verify step at k drafts against a plain decode step: medians and ratios."""
    plain, verify, sinks = _engines(loaded, k, context, steps)
    for i in range(steps):
        order = (plain, verify) if i % 2 == 0 else (verify, plain)
        for engine in order:
            engine.step()
    plain_ms, verify_ms = _step_ms(sinks["plain"][-steps:]), _step_ms(sinks["verify"][-steps:])
    verify_rows = {s.logit_rows for s in sinks["verify"][-steps:]}
    kernels = {name: stats[-1].kernel for name, stats in sinks.items() if stats}
    split = _split(plain, verify, max(4, steps // 2))
    for engine in (plain, verify):
        engine.abort_all()
    return {
        "model": loaded.info.name,
        "quantization": loaded.info.quantization,
        "drafts": k,
        "context_tokens": context,
        "steps_each": steps,
        "verify_rows": sorted(verify_rows),
        "kernels": kernels,
        "plain": plain_ms,
        "verify": verify_ms,
        "verify_vs_plain": {
            key.removesuffix("_ms"): verify_ms[key] / plain_ms[key] if plain_ms[key] else float("nan")
            for key in ("step_ms", "forward_ms", "postprocess_ms")
        },
        "split_ms": split,
        "roof": panel_roof(loaded, k + 1, split),
    }


def panel_roof(loaded: LoadedModel, rows: int, split: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the panels' arithmetic lets a step of `rows` rows cost at least, on these cores.

    A row multiplies every panel weight once; the panels multiply 16-bit pairs, 32 products an
    instruction, and `pair_product_rate` measures how many such products these cores' threads
    reach on registers alone. So the linears of `rows` rows take at least compute_floor_ms, and no
    less than one row's linears, which read every weight once. floor_vs_plain puts the larger in
    the instrumented plain step in place of its linears, every other part left at its one-row
    time: a step of `rows` rows costs at least that many plain steps if nothing but the linears
    grew (attention, the head and the rest only grow with rows). Also how fast the verify step's
    linears ran against the compute roof."""
    storages = panel_storages(loaded.model)
    lib = storages[0].lib if storages else None
    rate = lib.pair_product_rate() if lib is not None else None
    if rate is None or "plain" not in split or "verify" not in split:
        return {
            "skipped": "no linears multiplied as panels in this build (AVX-512 VNNI, Q4_0/Q4_1/Q4_K/Q6_K)"
        }
    macs = sum(s.out_features * s.in_features for s in storages)
    compute_ms = rows * macs / rate * 1e3
    plain, verify = split["plain"], split["verify"]
    floor_step_ms = plain["step_ms"] - plain["linears_ms"] + max(compute_ms, plain["linears_ms"])
    return {
        "rows": rows,
        "panel_macs_per_row": macs,
        "pair_products_per_s": rate,
        "compute_floor_ms": compute_ms,
        "one_row_linears_ms": plain["linears_ms"],
        "floor_vs_plain": floor_step_ms / plain["step_ms"],
        "verify_linears_products_per_s": rows * macs / (verify["linears_ms"] / 1e3)
        if verify["linears_ms"]
        else 0.0,
    }


def _split(plain: LLMEngine, verify: LLMEngine, steps: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per step in the linears, the LM head, the attention and the rest of
    the forward, each engine instrumented in turn (the timers cost a little: not the headline)."""
    clock = _Clock()
    model = plain.loaded.model
    patched: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, clock.wrap(part, original))

    for module in model.modules():
        if isinstance(module, KernelHead):
            patch(module, "forward", "lm_head")
        elif isinstance(module, KernelLinear):
            patch(module, "forward", "linears")
    patch(forward_module, "attend", "attention")
    patch(attention_module, "attend", "attention")
    fused = {"plain": FusedClock(plain), "verify": FusedClock(verify)}
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "verify": []}
    try:
        for _ in range(steps):
            for name, engine in (("plain", plain), ("verify", verify)):
                if not engine.has_work():
                    continue
                clock.take()
                fused[name].take()
                start = time.perf_counter()
                engine.step()
                parts = clock.take()
                for part, seconds in zip(("linears", "attention"), fused[name].take()):
                    parts[part] = parts.get(part, 0.0) + seconds
                parts["step"] = time.perf_counter() - start
                rows[name].append(parts)
    finally:
        for timer in fused.values():
            timer.close()
        for owner, name, original in patched:
            if isinstance(owner, KernelLinear):
                del owner.forward  # the instance attribute: back to the class's method
            else:
                setattr(owner, name, original)
    out: dict[str, dict[str, float]] = {}
    for name, taken in rows.items():
        if not taken:
            continue
        keys = ("linears", "lm_head", "attention", "step")
        medians = {key: statistics.median(p.get(key, 0.0) for p in taken) * 1e3 for key in keys}
        medians["rest"] = medians["step"] - medians["linears"] - medians["lm_head"] - medians["attention"]
        out[name] = {f"{key}_ms": value for key, value in medians.items()}
    return out
