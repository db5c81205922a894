"""What a reply keeps about how it was made: the engine's figures, the model and weight scheme,
speculative decoding's figures and the sampling settings, stored as JSON and read back."""

from __future__ import annotations

import json

from app.chat.reply_stats import (
    KeptStats,
    describe_sampling,
    details_text,
    header_text,
    stored_sampling,
    with_reply_facts,
)
from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.events import ModelInfo, RequestStats

STATS = RequestStats(
    prompt_tokens=40,
    generated_tokens=30,
    cached_prompt_tokens=32,
    ttft_s=0.25,
    itl_s=(0.05,) * 29,
    tokens_per_s=20.0,
    preemptions=1,
    peak_blocks=5,
    spec_rounds=10,
    spec_drafted=40,
    spec_accepted=22,
)
INFO = ModelInfo(
    "SmolLM2", "default", "llama", "float32", "cpu", 30, 9, 3, 64, 576, 49152, 8192, 135_000_000, 1, 1, 1.0,
    quantization="int8-weight-only",
)  # fmt: skip


def test_the_engines_figures_and_the_speculation_are_kept_and_shown():
    config = EngineConfig(speculative=SpeculativeConfig("ngram", num_draft=4), kv_dtype="int8")
    kept = KeptStats.from_engine(STATS, INFO, config)
    assert (kept.generated_tokens, kept.tokens_per_s, kept.ttft_s) == (30, 20.0, 0.25)
    assert (kept.model, kept.weights, kept.kv_dtype) == ("SmolLM2", "int8-weight-only", "int8")
    assert kept.speculative["acceptance_rate"] == 22 / 40 and kept.speculative["mean_accepted_length"] == 2.2
    header = header_text("length", kept, "32 of 40 prompt tokens from the prefix cache")
    assert header == (
        "30 tokens · 20.0 tok/s · TTFT 250 ms (32 of 40 prompt tokens from the prefix cache) · "
        "int8-weight-only · ngram drafts 55% kept · stopped at the token limit"
    )
    params = SamplingParams(temperature=0.7, dry_multiplier=0.8, logit_bias=((5, 2.0),))
    details = details_text(kept, params)
    assert "Speculative (ngram, 4 drafts a round): 10 rounds, 22 of 40 drafts kept (55%)" in details
    assert "preempted 1×" in details and "KV cache: int8" in details
    assert "temperature 0.7" in details and "dry_multiplier 0.8" in details


def test_kept_facts_survive_json_and_give_back_the_settings():
    params = SamplingParams(temperature=0.0, banned_token_ids=(3,), dry_sequence_breakers=("\n",))
    meta = with_reply_facts(
        {"group_reply": 1}, KeptStats.from_engine(STATS, INFO, None), params, {"first_kept": 2}
    )
    again = json.loads(json.dumps(meta))
    assert again["group_reply"] == 1 and again["context"] == {"first_kept": 2}
    assert KeptStats.from_meta(again) == KeptStats.from_engine(STATS, INFO, None)
    assert stored_sampling(again) == params
    assert stored_sampling({"sampling": {"temperature": -1}}) is None  # no longer valid: none
    assert KeptStats.from_meta({"stats": "junk"}) is None and stored_sampling(None) is None
    assert describe_sampling(SamplingParams()) == "the engine's defaults"
    assert header_text("interrupted", None) == "interrupted (kvscope stopped mid-reply)"
