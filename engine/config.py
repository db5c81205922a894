"""Engine and request configuration: frozen, slotted, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
# The model spec's default weight scheme: a GGUF file keeps its own blocks ("native"), any other
# source loads in full precision ("none"). engine.model.loading resolves it.
AUTO = "auto"
DEVICES = ("auto", "cpu", "cuda")
# KV-cache storage: "auto" the model's dtype (float16 for a GGUF at its own bits:
# engine.shapes.auto_kv_dtype), "float16" whatever the model, "int8" codes with a scale per token
# and head.
KV_DTYPES = ("auto", "float16", "int8")


class ConfigError(ValueError):
    """A configuration value is out of range; the message says which and why."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# text-generation-webui's and llama.cpp's default DRY sequence breakers.
DRY_DEFAULT_BREAKERS = ("\n", ":", '"', "*")
# base^(L - allowed) with L capped at DRY_MAX_MATCH (engine.sampling.stages) stays finite in float32.
DRY_MAX_BASE = 5.0
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: +-100 already bans or forces a token
# Dividing logits by less overflows float32 to inf, and the softmax to NaN (found by fuzzing the
# server: a temperature or repetition penalty of 5e-324 broke the step). vLLM raises a
# temperature under 0.01 to it; here it is refused, with the range in the message.
MIN_TEMPERATURE = 0.01
# Above this the distribution is uniform to float32's precision; a temperature past float32's
# range (the fuzzer's 1e308) becomes inf there and turns the grammar's -inf logits into NaN.
MAX_TEMPERATURE = 1e4
PENALTY_RANGE = (0.01, 100.0)  # the repetition penalty divides (or multiplies) logits by it
LENGTH_PENALTY_LIMIT = 10.0  # a beam's score is divided by its length to this power
# what a logit bias may be given as (the dataclass normalises it to the tuple form)
BiasPairs = dict[int, float] | Iterable[tuple[int, float]] | Iterable[list[float]]


def _bias_pairs(pairs: BiasPairs) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs from a tuple, a list of 2-lists (JSON) or a {id: bias} dict."""
    items = pairs.items() if isinstance(pairs, dict) else pairs
    try:
        return tuple((int(token), float(bias)) for token, bias in items)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"logit bias must be (token id, bias) pairs, got {pairs!r}") from exc


# What a grammar may be written as (engine.grammar.compile turns each into the library's form):
# a JSON Schema, any JSON object, a regular expression, a Lark or GBNF grammar, or a list of
# choices (the text is a JSON array of strings).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")
GRAMMAR_KIND_LABELS = {
    "json_schema": "JSON Schema",
    "json_object": "any JSON object",
    "regex": "regular expression",
    "lark": "Lark grammar",
    "gbnf": "GBNF grammar",
    "choice": "one of a list of choices",
}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """Constrained decoding: what the reply must match. Only the kind and the text are checked
    here; whether the text compiles is engine.grammar's question (it needs the library)."""

    kind: str
    text: str = ""  # the schema (JSON), the regex, the grammar, or the choices as a JSON array

    def __post_init__(self) -> None:
        _check(
            self.kind in GRAMMAR_KINDS,
            f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}",
        )
        _check(isinstance(self.text, str), "a grammar's text must be a string")
        _check(
            self.kind == "json_object" or bool(self.text.strip()),
            f"a {GRAMMAR_KIND_LABELS[self.kind]} needs its text (it is empty)",
        )

    @property
    def label(self) -> str:
        return GRAMMAR_KIND_LABELS[self.kind]


def _grammar(value: object) -> GrammarSpec | None:
    """A grammar as given: a GrammarSpec, its dict form (JSON: settings, stored replies) or None."""
    if value is None or isinstance(value, GrammarSpec):
        return value
    if isinstance(value, dict) and set(value) <= {"kind", "text"} and "kind" in value:
        return GrammarSpec(str(value["kind"]), str(value.get("text", "")))
    raise ConfigError(f"grammar must be a GrammarSpec or {{'kind', 'text'}}, got {value!r:.80}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen. Defaults are greedy-free sampling at temperature 1."""

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    repetition_penalty: float = 1.0  # 1 disables (CTRL-style, divides positive logits)
    presence_penalty: float = 0.0  # OpenAI-style: subtract once per seen token
    frequency_penalty: float = 0.0  # OpenAI-style: subtract per occurrence
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Record a per-token snapshot with this many candidates (0 = none).
    snapshot_top_n: int = 0
    # Typical sampling (Meister et al. 2022, transformers' TypicalLogitsWarper): keep the tokens
    # whose surprise is closest to the distribution's entropy, up to this mass (1 disables).
    typical_p: float = 1.0
    # DRY, "don't repeat yourself" (text-generation-webui, llama.cpp): a token that would extend
    # a sequence already in the text by its (L+1)-th token loses multiplier * base^(L - allowed)
    # from its logit, for L >= allowed_length. 0 disables. Breakers end a matched sequence: a
    # token whose text contains one never matches. penalty_last_n: 0 = the whole text.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0
    dry_sequence_breakers: tuple[str, ...] = DRY_DEFAULT_BREAKERS
    # XTC, "exclude top choices": with probability xtc_probability, every token at or above
    # xtc_threshold except the least likely of them is removed (0 disables).
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    # Added to the logits of these token ids (OpenAI's logit_bias: -100..100), and tokens that
    # can never be drawn. The app types them as text and shows them as tokens.
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    # Parallel samples of one prompt: the prompt is prefilled once and its KV blocks are shared
    # by the n sequences (copy-on-write where they diverge). Sample i draws with seed + i.
    n: int = 1
    # Beam search (1 = off): transformers' generate(num_beams=K, do_sample=False) semantics.
    num_beams: int = 1
    # A finished beam scores sum(log-probs) / generated_len ** length_penalty (> 0 favours long).
    length_penalty: float = 1.0
    # When the search ends: True (once num_beams hypotheses are finished), False (when the best
    # running beam can no longer beat them, by transformers' heuristic) or "never" (the exact
    # test). Same meaning as transformers' `early_stopping`.
    early_stopping: bool | str = False
    # Constrained decoding: the grammar's token mask is the sampler's first stage (None: off).
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Sequences arrive as lists from JSON (settings, presets, stored replies): store tuples so
        # params stay hashable and compare equal however they were made.
        for name in ("stop", "dry_sequence_breakers", "banned_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "grammar", _grammar(self.grammar))
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(
            self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}")
        _check(
            PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1],
            f"repetition_penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.snapshot_top_n >= 0, f"snapshot_top_n must be >= 0, got {self.snapshot_top_n}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        self._check_group()
        self._check_more_samplers()

    def _check_more_samplers(self) -> None:
        _check(0.0 < self.typical_p <= 1.0, f"typical_p must be in (0, 1], got {self.typical_p}")
        _check(
            math.isfinite(self.dry_multiplier) and self.dry_multiplier >= 0.0,
            f"dry_multiplier must be >= 0 (0 disables), got {self.dry_multiplier}",
        )
        _check(
            1.0 <= self.dry_base <= DRY_MAX_BASE,
            f"dry_base must be in [1, {DRY_MAX_BASE:g}], got {self.dry_base}",
        )
        _check(
            self.dry_allowed_length >= 1, f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}"
        )
        _check(
            self.dry_penalty_last_n >= 0,
            f"dry_penalty_last_n must be >= 0 (0 = the whole text), got {self.dry_penalty_last_n}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.dry_sequence_breakers),
            "DRY sequence breakers must be non-empty strings",
        )
        _check(
            0.0 < self.xtc_threshold <= 0.5,
            f"xtc_threshold must be in (0, 0.5] (two tokens cannot both exceed 0.5), got {self.xtc_threshold}",
        )
        _check(
            0.0 <= self.xtc_probability <= 1.0,
            f"xtc_probability must be in [0, 1], got {self.xtc_probability}",
        )
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0, f"logit bias token ids must be >= 0, got {token_id}")
            _check(
                math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT,
                f"a logit bias must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias} for token {token_id}",
            )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.banned_token_ids),
            "banned token ids must be integers >= 0",
        )

    def _check_group(self) -> None:
        _check(self.n >= 1, f"n (parallel samples) must be >= 1, got {self.n}")
        _check(self.num_beams >= 1, f"num_beams must be >= 1, got {self.num_beams}")
        _check(
            self.n == 1 or self.num_beams == 1,
            "choose either n parallel samples or beam search (num_beams), not both",
        )
        _check(
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never",
            f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
        )
        _check(
            -LENGTH_PENALTY_LIMIT <= self.length_penalty <= LENGTH_PENALTY_LIMIT,
            f"length_penalty must be in [-{LENGTH_PENALTY_LIMIT:g}, {LENGTH_PENALTY_LIMIT:g}], got {self.length_penalty}",
        )
        if self.num_beams > 1:
            _check(
                self.temperature == 0.0,
                "beam search picks the best-scoring beams, it does not sample: set temperature 0",
            )
            _check(not self.stop, "stop strings are not supported with beam search")
        if self.n > 1:
            _check(
                self.temperature > 0.0,
                "n > 1 greedy samples would all be the same reply: set a temperature above 0",
            )

    @property
    def group_size(self) -> int:
        """Sequences the request runs at once: n samples or num_beams beams (1 for a plain reply)."""
        return max(self.n, self.num_beams)

    @property
    def beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model to load and how. `source` is 'default', a folder, a .gguf file or a cached repo id."""

    source: str = "default"
    dtype: str = "float32"
    device: str = "auto"
    quantization: str = AUTO  # a scheme name from engine.quant.schemes (validated there), or auto

    def __post_init__(self) -> None:
        _check(bool(self.source), "model source must not be empty")
        _check(bool(self.quantization), "quantization must name a scheme ('none' for full precision)")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")


SPECULATIVE_METHODS = ("ngram", "draft", "self")


# The most draft tokens a round may have: its 1 + MAX_NUM_DRAFT rows all attend row by row
# (engine/model/row_attention.ROW_LIMIT), as the decodes they stand for.
MAX_NUM_DRAFT = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes draft tokens and how many per round."""

    method: str = "ngram"  # "ngram" prompt lookup, "draft" another model, "self" the target for itself (its hidden state or first layers)
    num_draft: int = 4  # draft tokens per round (the most, when adaptive)
    draft_model: str | None = None  # for "draft": a model source sharing the target's tokenizer
    # for "self": None the calibration's choice, 0 a draft from the target's hidden state
    # (engine/speculative/hidden_draft.py), n the target's first n layers
    self_draft_layers: int | None = None
    adaptive: bool = True  # each sequence's draft length from its recent acceptance and the measured costs

    def __post_init__(self) -> None:
        _check(self.method in SPECULATIVE_METHODS, f"speculative method must be one of {SPECULATIVE_METHODS}")
        _check(
            1 <= self.num_draft <= MAX_NUM_DRAFT,
            f"num_draft must be in [1, {MAX_NUM_DRAFT}], got {self.num_draft}",
        )
        _check(self.method != "draft" or bool(self.draft_model), "speculative 'draft' needs a draft model")
        _check(
            self.self_draft_layers is None or self.self_draft_layers >= 0,
            f"self_draft_layers must be 0 (the hidden state) or more, got {self.self_draft_layers}",
        )


# Without an explicit size the KV pool gets this much memory: room for several thousand tokens
# of a small model, and few enough blocks that every one is visible in the page map.
DEFAULT_KV_BUDGET_BYTES = 256 * 2**20
# Context cap when the model's own is larger and nothing else is configured.
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of the paged KV cache and the scheduler's per-step limits."""

    model: ModelSpec = field(default_factory=ModelSpec)
    block_size: int = 16
    # KV pool size: an explicit block count wins; else a memory budget in bytes (the engine's
    # DEFAULT_KV_BUDGET_BYTES when neither is given).
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    max_model_len: int | None = None  # defaults to the model's context length (capped at 8192)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    prefill_chunk_size: int | None = None  # cap on one sequence's prefill tokens per step
    enable_prefix_caching: bool = True
    kv_dtype: str = "auto"  # one of KV_DTYPES
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _check(
            self.kv_dtype in KV_DTYPES,
            f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}",
        )
        _check(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _check(
            self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}"
        )
        _check(
            self.kv_budget_bytes is None or self.kv_budget_bytes > 0,
            f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(
            self.prefill_chunk_size is None or self.prefill_chunk_size >= 1,
            f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}",
        )
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
