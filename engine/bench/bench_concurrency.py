"""`python -m engine bench --concurrency 1,2,4,8`: continuous batching against running the same
requests one by one, in one process, and prefix caching's effect on TTFT for a long shared
system prompt. Everything printed is measured in this run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import Request
from engine.units import milliseconds, tokens_per_s

if TYPE_CHECKING:
    from engine.model.loaded import LoadedModel

TOPICS = [
    "the water cycle", "how a bicycle gear works", "why leaves change colour", "the history of paper",
    "how vaccines train the immune system", "what a compiler does", "how tides work", "the life of a star",
    "why bread rises", "how a refrigerator cools", "what causes earthquakes", "how bees communicate",
    "how a lock and key work", "why the sky is blue", "how batteries store energy", "how maps are made",
]  # fmt: skip
# A long system prompt shared by every request of the prefix-cache measurement.
SHARED_SYSTEM = " ".join(
    f"Rule {i}: answer clearly, cite the relevant principle, keep a friendly tone, and avoid jargon "
    f"unless the user asks for it; when unsure about point {i}, say so."
    for i in range(1, 31)
)


def _requests(n: int, new_tokens: int) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    return [
        Request.chat(f"Explain {TOPICS[i % len(TOPICS)]} (variant {i}).", sampling=params) for i in range(n)
    ]


def _run(engine: LLMEngine, requests: list[Request]) -> tuple[float, list[RequestFinished]]:
    """Submit all requests at once and step until they end; returns wall time and results."""
    start = time.perf_counter()
    ends = engine.run(requests)
    return time.perf_counter() - start, [e for e in ends if isinstance(e, RequestFinished)]


def measure_levels(
    loaded: LoadedModel, levels: list[int], new_tokens: int, block_size: int
) -> list[dict[str, Any]]:
    config = EngineConfig(block_size=block_size, max_num_seqs=max(levels), enable_prefix_caching=False)
    engine = LLMEngine(loaded, config)
    _run(engine, _requests(1, 4))  # warm-up
    out = []
    for c in levels:
        print(f"concurrency {c}: batched", file=sys.stderr)
        requests = _requests(c, new_tokens)
        batched_s, batched = _run(engine, requests)
        print(f"concurrency {c}: one by one", file=sys.stderr)
        sequential_s = sum(_run(engine, [r])[0] for r in requests)
        generated = sum(f.stats.generated_tokens for f in batched)
        itls = [x for f in batched for x in f.stats.itl_s]
        out.append(
            {
                "concurrency": c,
                "total_tokens_per_s": tokens_per_s(generated, batched_s),
                "sequential_tokens_per_s": tokens_per_s(generated, sequential_s),
                "speedup": sequential_s / batched_s,
                "median_itl_s": statistics.median(itls),
                "median_ttft_s": statistics.median(f.stats.ttft_s for f in batched),
            }
        )
    return out


def measure_prefix_cache(loaded: LoadedModel, block_size: int) -> dict[str, Any]:
    engine = LLMEngine(loaded, EngineConfig(block_size=block_size, enable_prefix_caching=True))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    results = []
    for question in ("What is rule 3 about?", "Summarise rule 7."):
        _, (done,) = _run(engine, [Request.chat(question, system=SHARED_SYSTEM, sampling=params)])
        results.append(done.stats)
    cold, cached = results
    return {
        "prompt_tokens": cached.prompt_tokens,
        "cached_prompt_tokens": cached.cached_prompt_tokens,
        "ttft_cold_s": cold.ttft_s,
        "ttft_cached_s": cached.ttft_s,
        "ttft_speedup": cold.ttft_s / cached.ttft_s,
    }


def run_concurrency_bench(args: argparse.Namespace, loaded: LoadedModel) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "dtype": loaded.info.dtype,
        "new_tokens": args.new_tokens,
        "levels": measure_levels(loaded, levels, args.new_tokens, args.block_size),
        "prefix_cache": measure_prefix_cache(loaded, args.block_size),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{'concurrency':>12}{'batched tok/s':>15}{'one-by-one tok/s':>18}{'speedup':>9}{'median ITL ms':>15}"
    )
    for lv in report["levels"]:
        print(
            f"{lv['concurrency']:>12}{lv['total_tokens_per_s']:>15.2f}{lv['sequential_tokens_per_s']:>18.2f}"
            f"{lv['speedup']:>9.2f}{lv['median_itl_s'] * 1000:>15.1f}"
        )
    pc = report["prefix_cache"]
    print(
        f"prefix cache: {pc['cached_prompt_tokens']}/{pc['prompt_tokens']} prompt tokens cached; "
        f"TTFT cold {milliseconds(pc['ttft_cold_s'])}, cached {milliseconds(pc['ttft_cached_s'])}"
    )
    return 0
