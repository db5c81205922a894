"""What each reply keeps about how it was made, stored with the message (its `meta`): tokens,
tok/s, TTFT, the prompt and how much of it the prefix cache served, the model, its weight
scheme and precision, speculative decoding's figures, and the sampling settings, so an old
reply can be read, compared and regenerated with the settings it was made with.

All figures are the engine's (RequestStats, ModelInfo, the engine's config) at the moment the
reply finished; nothing here is computed from the GUI's own clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.events import ModelInfo, RequestStats

STATS_KEY, SAMPLING_KEY, CONTEXT_KEY = "stats", "sampling", "context"
FINISH_LABELS = {
    "stop": "",
    "length": "stopped at the token limit",
    "cancelled": "stopped",
    "failed": "failed",
    "interrupted": "interrupted (kvscope stopped mid-reply)",
    "grammar": "ended: the grammar permitted no next token",
}
DEFAULT_PARAMS = SamplingParams()


@dataclass(frozen=True, slots=True)
class KeptStats:
    """A finished reply's figures; reads like RequestStats where app.prefix_ttft needs it."""

    generated_tokens: int
    tokens_per_s: float
    ttft_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    preemptions: int = 0
    model: str = ""
    weights: str = "none"  # the quantization scheme applied at load ("none": the load dtype)
    dtype: str = ""
    device: str = ""
    kv_dtype: str = "auto"
    speculative: dict[str, Any] | None = None  # method, num_draft, rounds, drafted, accepted, rates

    @classmethod
    def from_engine(
        cls, stats: RequestStats, info: ModelInfo | None, config: EngineConfig | None
    ) -> KeptStats:
        spec = None
        if config is not None and config.speculative is not None:
            spec = {
                "method": config.speculative.method,
                "num_draft": config.speculative.num_draft,
                "rounds": stats.spec_rounds,
                "drafted": stats.spec_drafted,
                "accepted": stats.spec_accepted,
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length,
            }
        return cls(
            generated_tokens=stats.generated_tokens,
            tokens_per_s=stats.tokens_per_s,
            ttft_s=stats.ttft_s,
            prompt_tokens=stats.prompt_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            preemptions=stats.preemptions,
            model=info.name if info else "",
            weights=info.quantization if info else "none",
            dtype=info.dtype if info else "",
            device=info.device if info else "",
            # what the pool stores ("auto" where the engine is remote: its pool is not known here)
            kv_dtype=info.kv_stored_as(config.kv_dtype) if info and config else "auto",
            speculative=spec,
        )

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> KeptStats | None:
        raw = (meta or {}).get(STATS_KEY)
        if not isinstance(raw, dict):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except TypeError:
            return None


def with_reply_facts(
    meta: dict[str, Any] | None,
    stats: KeptStats | None,
    sampling: SamplingParams | None,
    context: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """`meta` (a group reply's alternatives, or nothing) plus the kept stats and settings."""
    out = dict(meta or {})
    if stats is not None:
        out[STATS_KEY] = stats.to_meta()
    if sampling is not None:
        out[SAMPLING_KEY] = dataclasses.asdict(sampling)
    if context:
        out[CONTEXT_KEY] = context
    return out or None


def stored_sampling(meta: dict[str, Any] | None) -> SamplingParams | None:
    """The settings a reply was made with (None when it predates kept settings or they no
    longer validate in this version)."""
    raw = (meta or {}).get(SAMPLING_KEY)
    if not isinstance(raw, dict):
        return None
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    try:
        return SamplingParams(**{k: v for k, v in raw.items() if k in names})
    except (ConfigError, TypeError, ValueError):
        return None


def dropped_before(meta: dict[str, Any] | None) -> int:
    """How many leading messages of the path the reply's prompt left out (the context limit):
    the path position of the first message it was given."""
    raw = (meta or {}).get(CONTEXT_KEY)
    value = raw.get("first_kept", 0) if isinstance(raw, dict) else 0
    return value if isinstance(value, int) and value > 0 else 0


# ---- text ------------------------------------------------------------------------------------
def header_text(finish_reason: str | None, stats: KeptStats | None, cache_note: str = "") -> str:
    """The reply header: the figures a reader compares at a glance, then how it ended."""
    parts = []
    if stats is not None and stats.generated_tokens:
        parts.append(f"{stats.generated_tokens} tokens")
        if stats.tokens_per_s > 0:
            parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        parts.append(f"TTFT {stats.ttft_s * 1000:.0f} ms" + (f" ({cache_note})" if cache_note else ""))
        if stats.weights and stats.weights != "none":
            parts.append(stats.weights)
        if stats.speculative:
            parts.append(
                f"{stats.speculative['method']} drafts {stats.speculative['acceptance_rate']:.0%} kept"
            )
    label = FINISH_LABELS.get(finish_reason or "", finish_reason or "")
    if label:
        parts.append(label)
    return " · ".join(parts)


def details_text(stats: KeptStats | None, sampling: SamplingParams | None) -> str:
    """The tooltip: every kept figure and the settings that differ from the engine's neutral ones."""
    lines = []
    if stats is not None:
        lines += [
            f"Model: {stats.model or '?'} ({stats.dtype} on {stats.device}, weights: {stats.weights}, "
            f"KV cache: {stats.kv_dtype})",
            f"{stats.generated_tokens} tokens at {stats.tokens_per_s:.1f} tok/s; TTFT {stats.ttft_s * 1000:.0f} ms",
            f"Prompt: {stats.prompt_tokens} tokens, {stats.cached_prompt_tokens} from the prefix cache"
            + (f"; preempted {stats.preemptions}×" if stats.preemptions else ""),
        ]
        spec = stats.speculative
        if spec:
            lines.append(
                f"Speculative ({spec['method']}, {spec['num_draft']} drafts a round): {spec['rounds']} rounds, "
                f"{spec['accepted']} of {spec['drafted']} drafts kept ({spec['acceptance_rate']:.0%}), "
                f"{spec['mean_accepted_length']:.2f} kept per round"
            )
    if sampling is not None:
        lines.append("Sampling: " + describe_sampling(sampling))
    return "\n".join(lines)


def describe_sampling(params: SamplingParams) -> str:
    """The settings that differ from SamplingParams' neutral defaults, as `name value`."""
    skip = {"snapshot_top_n"}
    parts = []
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name in skip or value == getattr(DEFAULT_PARAMS, f.name):
            continue
        if f.name == "temperature" and value == 0.0:
            parts.append("greedy (temperature 0)")
        elif isinstance(value, tuple) and len(value) > 4:
            parts.append(f"{f.name} ({len(value)} entries)")
        elif isinstance(value, float):
            parts.append(f"{f.name} {value:g}")
        elif isinstance(value, (str, tuple)):
            parts.append(f"{f.name} {value!r}")
        else:
            parts.append(f"{f.name} {value}")
    return ", ".join(parts) or "the engine's defaults"
