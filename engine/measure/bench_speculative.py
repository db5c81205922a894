"""`python -m engine bench --speculation`: speculative decoding against plain decoding on the
same engine, model and prompts, in one run: a repeat-this-text task (where n-gram lookup
shines) and free chat, for the n-gram and the self-draft proposers. Speedup < 1 is reported as
it is: speculation costs a draft and a wider verify forward, and pays only when drafts land."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import Event, RequestFinished
from engine.request import Request

if TYPE_CHECKING:
    from engine.model.loaded import LoadedModel

PASSAGE = (
    "The lighthouse stood at the end of the long stone pier. Every night the keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, polished the great lens, and watched "
    "the beam sweep across the dark water until the first grey light of morning."
)
TASKS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "chat": "What are three good habits for staying healthy? Explain each briefly.",
}


def proposers(num_layers: int, num_draft: int) -> dict[str, SpeculativeConfig | None]:
    return {
        "none": None,
        "ngram": SpeculativeConfig("ngram", num_draft=num_draft),
        "self": SpeculativeConfig("self", num_draft=num_draft, self_draft_layers=max(1, num_layers // 4)),
    }


def _one(
    loaded: LoadedModel, spec: SpeculativeConfig | None, prompt: str, new_tokens: int, block_size: int
) -> tuple[RequestFinished, float]:
    events: list[Event] = []
    engine = LLMEngine(loaded, EngineConfig(block_size=block_size, speculative=spec), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request(Request.chat(prompt, sampling=params))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    return done, time.perf_counter() - start


def run_speculative_bench(args: argparse.Namespace, loaded: LoadedModel) -> int:
    configs = proposers(loaded.info.num_layers, args.num_draft)
    _one(loaded, None, "Hello", 4, args.block_size)  # warm-up
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "dtype": loaded.info.dtype,
        "new_tokens": args.new_tokens,
        "tasks": {},
    }
    for task, prompt in TASKS.items():
        rows: dict[str, dict[str, Any]] = {}
        for name, spec in configs.items():
            print(f"{task}: {name}", file=sys.stderr)
            done, seconds = _one(loaded, spec, prompt, args.new_tokens, args.block_size)
            s = done.stats
            rows[name] = {
                "tokens_per_s": s.generated_tokens / seconds,
                "acceptance_rate": s.acceptance_rate,
                "mean_accepted_length": s.mean_accepted_length,
                "target_forwards_per_token": s.target_forwards / s.generated_tokens,
                "token_ids": list(done.token_ids),
            }
        plain_ids, plain_speed = rows["none"]["token_ids"], rows["none"]["tokens_per_s"]
        for row in rows.values():
            row["speedup"] = row["tokens_per_s"] / plain_speed
            row["output_equals_plain"] = row.pop("token_ids") == plain_ids
        report["tasks"][task] = rows
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for task, rows in report["tasks"].items():
        print(f"{task}:")
        for name, row in rows.items():
            print(
                f"  {name:6} {row['tokens_per_s']:7.2f} tok/s  speedup {row['speedup']:.2f}  "
                f"acceptance {row['acceptance_rate']:.0%}  mean accepted {row['mean_accepted_length']:.2f}  "
                f"forwards/token {row['target_forwards_per_token']:.2f}"
            )
    return 0
