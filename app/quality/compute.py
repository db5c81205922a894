"""What the running quantization costs against full precision: the computation of one run, on
the calling thread (the QualityRunner calls it from a worker).

The run loads the job's model spec twice, one copy after the other so only one is in memory at a
time: as the engine runs it (weight scheme, KV dtype) and unquantized. Both read the same tokens
(teacher forcing, engine.measure.quality) and the run compares their next-token distributions at every
position: KL(reference || quantized), top-1 agreement, the perplexity of each. Each copy also
answers a short greedy request through an LLMEngine, so the scheme's decode speed is measured
next to full precision's in the same run.

Fresh copies rather than the engine's own model: that one belongs to the engine thread (a paged
forward swaps the attention implementation on the model's config), and quantizing is
deterministic, so the copy computes what the engine computes.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.quality.jobs import EVAL_TEXT, QualityJob, QualityUnavailable, ReplyTokens
from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.request import Request
from widgets.reference import ReferenceDistribution

if TYPE_CHECKING:
    from engine.measure.quality import QualityReport  # torch: imported where a run needs it

# The longest text compared; a longer conversation keeps its last tokens. Both models' float32
# logits are held at once: 2 x 2048 x 49k x 4 B = 0.8 GB for SmolLM2's vocabulary.
MAX_TOKENS = 2048
# The speed request's prompt: at most this many of the text's first tokens; a 2-token warm-up
# request first pays the first-call allocations.
SPEED_PROMPT_TOKENS = 128
SPEED_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SpeedFigures:
    decode_tok_s: float
    prefill_tok_s: float
    new_tokens: int


@dataclass(frozen=True, slots=True)
class QualityResult:
    job: QualityJob
    report: QualityReport  # over `token_ids`
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    reply_start: int | None  # position of the reply's first token in token_ids (None: no reply)
    truncated: int  # tokens dropped from the start to stay within MAX_TOKENS
    reference: dict[int, ReferenceDistribution]  # reply token index -> reference there
    quantized_speed: SpeedFigures | None
    reference_speed: SpeedFigures | None
    seconds: float

    @property
    def scheme(self) -> str:
        return self.job.spec.quantization

    @property
    def reference_label(self) -> str:
        return reference_label(self.job.spec)


def reference_label(spec: ModelSpec) -> str:
    return f"full precision ({spec.dtype})"


def compute_quality(
    job: QualityJob, progress: Callable[[str], None] = lambda text: None, cancelled=lambda: False
) -> QualityResult | None:
    """The whole run, on the calling thread; None when `cancelled()` turned true on the way."""
    from engine.measure.quality import compare_logits, teacher_forced_logits

    start = time.perf_counter()
    progress(f"loading {job.spec.quantization} (as the engine runs it)")
    quantized = _load(job.spec, "the quantized model")
    ids, reply_start, truncated = _token_ids(job, quantized)
    if cancelled():
        return None
    progress(f"{job.spec.quantization}: distributions over {len(ids)} tokens")
    q_logits = teacher_forced_logits(quantized.model, ids, job.kv_dtype)
    q_speed = _speed(quantized, job.kv_dtype, ids, job.speed_tokens, progress, job.spec.quantization)
    texts = tuple(quantized.tokenizer.decode([i]) for i in ids)
    del quantized
    gc.collect()  # the quantized copy must be gone before the reference arrives
    if cancelled():
        return None

    reference_spec = dataclasses.replace(job.spec, quantization="none")
    _check_memory(reference_spec, len(ids))
    progress(f"loading the full-precision reference ({job.spec.dtype})")
    reference = _load(reference_spec, "the full-precision reference")
    if cancelled():
        return None
    progress(f"reference: distributions over {len(ids)} tokens")
    r_logits = teacher_forced_logits(reference.model, ids)
    r_speed = _speed(reference, "auto", ids, job.speed_tokens, progress, "full precision")
    report = compare_logits(r_logits, q_logits.to(r_logits.device), ids)
    overlay = {}
    if reply_start is not None and job.reply is not None:
        overlay = _reference_overlay(
            r_logits, job.reply, reply_start, report, reference.tokenizer, reference_label(job.spec)
        )
    del reference
    return QualityResult(
        job,
        report,
        tuple(ids),
        texts,
        reply_start,
        truncated,
        overlay,
        q_speed,
        r_speed,
        time.perf_counter() - start,
    )


def _load(spec: ModelSpec, what: str):
    from engine.model.errors import ModelLoadError
    from engine.model.loading import load_model

    try:
        return load_model(spec)
    except (ModelLoadError, ValueError) as exc:  # ConfigError (a scheme refused) is a ValueError
        raise QualityUnavailable(f"{what[0].upper()}{what[1:]} could not be loaded: {exc}") from None
    except MemoryError:
        raise QualityUnavailable(f"Ran out of memory loading {what}.") from None


def _token_ids(job: QualityJob, loaded) -> tuple[list[int], int | None, int]:
    """(ids, the reply's start in them or None, tokens cut from the start)."""
    from engine.core.llm_engine import LLMEngine
    from engine.measure.quality import eval_token_ids

    reply_start = None
    if job.source == EVAL_TEXT:
        ids = eval_token_ids(loaded.tokenizer)
    else:
        if not job.messages:
            raise QualityUnavailable(
                "The conversation is empty: send a message first, or use the evaluation text."
            )
        # The engine's own rule for turning messages into a prompt (chat template, no extra BOS).
        engine = LLMEngine(loaded, EngineConfig(model=job.spec, num_blocks=1))
        request = Request(messages=job.messages)
        if job.reply is not None:
            ids = engine.prompt_ids(request)
            # A different count means the prompt changed since (the system prompt was edited):
            # the text is still compared, but the positions no longer match the engine's tokens.
            reply_start = len(ids) if len(ids) == job.reply.prompt_tokens else None
            ids += list(job.reply.token_ids)
        else:
            text = loaded.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in job.messages], tokenize=False
            )
            ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < 2:
        raise QualityUnavailable("The text is a single token: there is nothing to predict yet.")
    truncated = max(0, len(ids) - MAX_TOKENS)
    if truncated:
        ids = ids[truncated:]
        reply_start = reply_start - truncated if reply_start is not None else None
    return ids, reply_start, truncated


def _check_memory(spec: ModelSpec, num_tokens: int) -> None:
    """The reference's weights plus its logits must fit in what is free now (the quantized
    logits are already held and so already out of the free figure)."""
    import torch

    from engine.measure.memory import available_memory_bytes
    from engine.model.checks import resolve_device
    from engine.model.configs import read_config
    from engine.model.shapes import ModelShapes
    from engine.model.sources import resolve_source
    from engine.units import format_bytes

    shapes = ModelShapes.from_config(read_config(resolve_source(spec.source)))
    weights = shapes.weight_bytes(spec.dtype)
    logits = num_tokens * shapes.vocab_size * torch.finfo(torch.float32).bits // 8
    available = available_memory_bytes(resolve_device(spec.device))
    if weights + logits > available:
        raise QualityUnavailable(
            f"Not enough memory to run the full-precision reference: it needs about "
            f"{format_bytes(weights + logits)} ({format_bytes(weights)} of {spec.dtype} weights and "
            f"{format_bytes(logits)} of logits for {num_tokens:,} tokens), but only {format_bytes(available)} "
            "is available next to the running engine. Compare on the shorter evaluation text, or free memory."
        )


def _speed(
    loaded, kv_dtype: str, ids: list[int], new_tokens: int, progress, what: str
) -> SpeedFigures | None:
    """Decode and prefill tokens/s of one greedy request through a private LLMEngine."""
    if new_tokens <= 0:
        return None
    from engine.core.llm_engine import LLMEngine
    from engine.events import RequestFailed, RequestFinished

    progress(f"{what}: timing {new_tokens} greedy tokens through the engine")
    prompt = tuple(ids[:SPEED_PROMPT_TOKENS])
    blocks = -(-(len(prompt) + new_tokens + 1) // SPEED_BLOCK_SIZE) + 1
    events: list = []
    config = EngineConfig(
        model=ModelSpec("speed"), num_blocks=blocks, kv_dtype=kv_dtype, enable_prefix_caching=False
    )
    engine = LLMEngine(loaded, config, events.append)
    finished = None
    for count in (2, new_tokens):  # warm-up, then the measured request
        events.clear()
        params = SamplingParams(temperature=0.0, max_new_tokens=count, ignore_eos=True)
        engine.add_request(Request(prompt_token_ids=prompt, sampling=params))
        while engine.has_work():
            engine.step()
        failed = next((e for e in events if isinstance(e, RequestFailed)), None)
        if failed is not None:
            raise QualityUnavailable(f"{what} failed to generate: {failed.message}")
        finished = next(e for e in events if isinstance(e, RequestFinished))
    stats = finished.stats
    prefill = stats.prompt_tokens / stats.ttft_s if stats.ttft_s > 0 else float("nan")
    return SpeedFigures(stats.tokens_per_s, prefill, stats.generated_tokens)


def _reference_overlay(r_logits, reply: ReplyTokens, start: int, report, tokenizer, label: str):
    """Per reply token: the reference's probabilities of the snapshot's candidates there."""
    import torch

    overlay = {}
    for index, candidates in enumerate(reply.candidate_ids):
        row = start + index - 1  # logits at row r predict the token at r + 1
        if not 0 <= row < len(report.kl):
            continue
        probs = torch.softmax(r_logits[row].float(), dim=-1)
        top_prob, top_id = probs.max(dim=-1)
        overlay[index] = ReferenceDistribution(
            label=label,
            probs={int(c): float(probs[c]) for c in candidates},
            top_id=int(top_id),
            top_text=tokenizer.decode([int(top_id)]),
            top_prob=float(top_prob),
            kl=report.kl[row],
        )
    return overlay
