"""What the running quantization costs against full precision, measured as the app asks for it:
one run on a conversation or on the shipped evaluation text, on the calling thread (a worker).

The run loads the model spec twice, one copy after the other so only one is in memory at a time:
as the engine runs it (weight scheme, KV dtype) and unquantized. Both read the same tokens
(teacher forcing, engine.model.logits) and the run compares their next-token distributions at
every position: KL(reference || quantized), top-1 agreement, the perplexity of each. Each copy
also answers a short greedy request through an LLMEngine, so the scheme's decode speed is
measured next to full precision's in the same run.

Fresh copies rather than the engine's own model: that one belongs to the engine thread (a paged
forward swaps the attention implementation on the model's config), and quantizing is
deterministic, so the copy computes what the engine computes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.bench.quality import compare_logits, eval_token_ids
from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.core import gc_heap
from engine.core.llm_engine import LLMEngine
from engine.errors import MeasurementError, ModelLoadError
from engine.events import RequestFailed, RequestFinished
from engine.limits import blocks_for_tokens
from engine.measure.device import resolve_device
from engine.measure.memory import available_memory_bytes
from engine.model.configs import read_config
from engine.model.loaded import LoadedModel
from engine.model.loading import load_model
from engine.model.logits import teacher_forced_logits
from engine.model.sources import resolve_source
from engine.request import ChatMessage, Request
from engine.results import QualityReport, SpeedFigures
from engine.shapes import ModelShapes
from engine.units import format_bytes, tokens_per_s

# The longest text compared; a longer conversation keeps its last tokens. Both models' float32
# logits are held at once: 2 x 2048 x 49k x 4 B = 0.8 GB for SmolLM2's vocabulary.
MAX_TOKENS = 2048
# The speed request's prompt: at most this many of the text's first tokens; a 2-token warm-up
# request first pays the first-call allocations.
SPEED_PROMPT_TOKENS = 128
SPEED_BLOCK_SIZE = 16
WARM_UP_TOKENS = 2


@dataclass(frozen=True, slots=True)
class ReferenceAt:
    """The full-precision reference at one reply token: its probabilities of the candidates the
    token's snapshot showed, its own top token, and the KL there."""

    probs: dict[int, float]
    top_id: int
    top_text: str
    top_prob: float
    kl: float


@dataclass(frozen=True, slots=True)
class QualityRun:
    report: QualityReport  # over `token_ids`
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    reply_start: int | None  # position of the reply's first token in token_ids (None: no reply)
    truncated: int  # tokens dropped from the start to stay within MAX_TOKENS
    references: dict[int, ReferenceAt]  # reply token index -> the reference there
    quantized_speed: SpeedFigures | None
    reference_speed: SpeedFigures | None
    seconds: float


def measure_quality(
    spec: ModelSpec,
    kv_dtype: str,
    messages: Sequence[ChatMessage] | None,
    reply_ids: Sequence[int] = (),
    reply_prompt_tokens: int | None = None,
    speed_tokens: int = 0,
    progress: Callable[[str], None] = lambda _text: None,
    cancelled: Callable[[], bool] = lambda: False,
    candidates: Sequence[Sequence[int]] = (),
) -> QualityRun | None:
    """The whole run; None when `cancelled()` turned true on the way. `messages` None: the
    shipped evaluation text. `reply_ids`: the reply the engine generated after `messages` (its
    exact tokens), when `reply_prompt_tokens` is the prompt the engine counted for it; then
    `candidates` (per reply token, the ids its snapshot showed) get the reference's figures."""
    start = time.perf_counter()
    progress(f"loading {spec.quantization} (as the engine runs it)")
    quantized = _load(spec, "the quantized model")
    ids, reply_start, truncated = _token_ids(quantized, spec, messages, reply_ids, reply_prompt_tokens)
    if cancelled():
        return None
    progress(f"{spec.quantization}: distributions over {len(ids)} tokens")
    q_logits = teacher_forced_logits(quantized.model, ids, quantized.kv_dtype_for(kv_dtype))
    q_speed = _speed(quantized, kv_dtype, ids, speed_tokens, progress, spec.quantization)
    texts = tuple(_text(quantized, i) for i in ids)
    del quantized
    gc_heap.collect()  # the quantized copy must be gone before the reference arrives (the app: on its GUI thread)
    if cancelled():
        return None

    reference_spec = dataclasses.replace(spec, quantization="none")
    _check_memory(reference_spec, len(ids))
    progress(f"loading the full-precision reference ({spec.dtype})")
    reference = _load(reference_spec, "the full-precision reference")
    if cancelled():
        return None
    progress(f"reference: distributions over {len(ids)} tokens")
    r_logits = teacher_forced_logits(reference.model, ids)
    r_speed = _speed(reference, "auto", ids, speed_tokens, progress, "full precision")
    report = compare_logits(r_logits, q_logits.to(r_logits.device), ids)
    references = {}
    if reply_start is not None and reply_ids:
        references = _references(r_logits, candidates, reply_start, report, reference)
    del reference
    return QualityRun(
        report,
        tuple(ids),
        texts,
        reply_start,
        truncated,
        references,
        q_speed,
        r_speed,
        time.perf_counter() - start,
    )


def _load(spec: ModelSpec, what: str) -> LoadedModel:
    try:
        return load_model(spec)
    except (ModelLoadError, ValueError) as exc:  # ConfigError (a scheme refused) is a ValueError
        raise MeasurementError(f"{what[0].upper()}{what[1:]} could not be loaded: {exc}") from None
    except MemoryError:
        raise MeasurementError(f"Ran out of memory loading {what}.") from None


def _token_ids(
    loaded: LoadedModel,
    spec: ModelSpec,
    messages: Sequence[ChatMessage] | None,
    reply_ids: Sequence[int],
    reply_prompt_tokens: int | None,
) -> tuple[list[int], int | None, int]:
    """(ids, the reply's start in them or None, tokens cut from the start)."""
    reply_start = None
    if messages is None:
        ids = eval_token_ids(loaded.tokenizer)
    else:
        if not messages:
            raise MeasurementError(
                "The conversation is empty: send a message first, or use the evaluation text."
            )
        if reply_ids:
            # The engine's own rule for turning messages into a prompt (chat template, no extra BOS).
            engine = LLMEngine(loaded, EngineConfig(model=spec, num_blocks=1))
            ids = engine.prompt_ids(Request(messages=tuple(messages)))
            # A different count means the prompt changed since (the system prompt was edited):
            # the text is still compared, but the positions no longer match the engine's tokens.
            reply_start = len(ids) if len(ids) == reply_prompt_tokens else None
            ids += list(reply_ids)
        else:
            text = loaded.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages], tokenize=False
            )
            ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < 2:
        raise MeasurementError("The text is a single token: there is nothing to predict yet.")
    truncated = max(0, len(ids) - MAX_TOKENS)
    if truncated:
        ids = ids[truncated:]
        reply_start = reply_start - truncated if reply_start is not None else None
    return ids, reply_start, truncated


def _check_memory(spec: ModelSpec, num_tokens: int) -> None:
    """The reference's weights plus its logits must fit in what is free now (the quantized
    logits are already held and so already out of the free figure)."""
    shapes = ModelShapes.from_config(read_config(resolve_source(spec.source)))
    weights = shapes.weight_bytes(spec.dtype)
    logits = num_tokens * shapes.vocab_size * torch.finfo(torch.float32).bits // 8
    available = available_memory_bytes(resolve_device(spec.device))
    if weights + logits > available:
        raise MeasurementError(
            f"Not enough memory to run the full-precision reference: it needs about "
            f"{format_bytes(weights + logits)} ({format_bytes(weights)} of {spec.dtype} weights and "
            f"{format_bytes(logits)} of logits for {num_tokens:,} tokens), but only {format_bytes(available)} "
            "is available next to the running engine. Compare on the shorter evaluation text, or free memory."
        )


def _speed(
    loaded: LoadedModel,
    kv_dtype: str,
    ids: list[int],
    new_tokens: int,
    progress: Callable[[str], None],
    what: str,
) -> SpeedFigures | None:
    """Decode and prefill tokens/s of one greedy request through a private LLMEngine."""
    if new_tokens <= 0:
        return None
    progress(f"{what}: timing {new_tokens} greedy tokens through the engine")
    prompt = tuple(ids[:SPEED_PROMPT_TOKENS])
    blocks = blocks_for_tokens(len(prompt) + new_tokens + 1, SPEED_BLOCK_SIZE) + 1
    config = EngineConfig(
        model=ModelSpec("speed"), num_blocks=blocks, kv_dtype=kv_dtype, enable_prefix_caching=False
    )
    engine = LLMEngine(loaded, config)
    finished: RequestFinished | None = None
    for count in (WARM_UP_TOKENS, new_tokens):  # warm-up, then the measured request
        params = SamplingParams(temperature=0.0, max_new_tokens=count, ignore_eos=True)
        (end,) = engine.run([Request(prompt_token_ids=prompt, sampling=params)])
        if isinstance(end, RequestFailed):
            raise MeasurementError(f"{what} failed to generate: {end.message}")
        finished = end
    assert finished is not None, "the measured request ran"
    stats = finished.stats
    prefill = tokens_per_s(stats.prompt_tokens, stats.ttft_s) if stats.ttft_s > 0 else float("nan")
    return SpeedFigures(stats.tokens_per_s, prefill, stats.generated_tokens)


def _references(
    r_logits: torch.Tensor,
    candidates: Sequence[Sequence[int]],
    start: int,
    report: QualityReport,
    reference: LoadedModel,
) -> dict[int, ReferenceAt]:
    """Per reply token: the reference's probabilities of the snapshot's candidates there."""
    out = {}
    for index, ids in enumerate(candidates):
        row = start + index - 1  # logits at row r predict the token at r + 1
        if not 0 <= row < len(report.kl):
            continue
        probs = torch.softmax(r_logits[row].float(), dim=-1)
        top_prob, top_id = probs.max(dim=-1)
        out[index] = ReferenceAt(
            probs={int(c): float(probs[c]) for c in ids},
            top_id=int(top_id),
            top_text=_text(reference, int(top_id)),
            top_prob=float(top_prob),
            kl=report.kl[row],
        )
    return out


def _text(loaded: LoadedModel, token_id: int) -> str:
    text = loaded.tokenizer.decode([token_id])
    assert isinstance(text, str), "one list of ids decodes to one string"
    return text
