"""A finished request's figures (RequestStats), built in one place for plain requests and groups."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.core.sequence import Sequence
from engine.events import RequestStats
from engine.units import tokens_per_s


def request_stats(
    first: Sequence,
    token_times: Seq[float],
    generated: int,
    *,
    streams: int = 1,
    preemptions: int | None = None,
    peak_blocks: int | None = None,
    target_forwards: int | None = None,
) -> RequestStats:
    """`first` is the request's own sequence (its prompt, cache hits, speculation record);
    `token_times` one time per step that gave the request tokens (its first step gives one token
    per stream: n samples or beams advance together; a speculative round gives several), so
    `itl_s` is one gap per step, as vLLM's inter-token latency, and tokens/s counts `generated`
    after the first step's over the time from the first step to the last."""
    times = list(token_times)
    decode_time = times[-1] - times[0] if len(times) > 1 else 0.0
    scheduled = first.first_scheduled_time if first.first_scheduled_time is not None else first.arrival_time
    return RequestStats(
        prompt_tokens=first.num_prompt_tokens,
        generated_tokens=generated,
        cached_prompt_tokens=first.num_cached_tokens,
        ttft_s=times[0] - first.arrival_time if times else 0.0,
        itl_s=tuple(b - a for a, b in zip(times, times[1:])),
        tokens_per_s=tokens_per_s(max(0, generated - streams), decode_time),
        preemptions=first.preemptions if preemptions is None else preemptions,
        peak_blocks=first.peak_blocks if peak_blocks is None else peak_blocks,
        target_forwards=first.target_forwards if target_forwards is None else target_forwards,
        spec_rounds=first.spec_rounds,
        spec_drafted=first.spec_drafted,
        spec_accepted=first.spec_accepted,
        spec_accepted_by_position=tuple(first.spec_accepted_by_position),
        spec_drafted_by_position=tuple(first.spec_drafted_by_position),
        spec_saved_s=first.spec_saved_s,
        queued_s=max(0.0, scheduled - first.arrival_time),
        prefill_s=max(0.0, times[0] - scheduled) if times else 0.0,
    )
