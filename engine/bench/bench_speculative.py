"""`python -m engine bench --speculation`: speculative decoding against plain decoding on the
same engine, model and prompts, in one run: a repeat-this-text task (where n-gram lookup
shines) and free chat, for the n-gram and the self-draft proposers. Speedup < 1 is reported as
it is: speculation costs a draft and a wider verify forward, and pays only when drafts land.
Each run is timed and its speedup counted as the app's "Measure speedup" does (engine.core.speedup)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.speedup import timed_run
from engine.events import RequestFinished
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.results import SpeedRun, SpeedupResult

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


def _request(prompt: str, new_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    return Request.chat(prompt, sampling=params)


def _row(done: RequestFinished, run: SpeedRun, speedup: float, equals_plain: bool) -> dict[str, Any]:
    s = done.stats
    return {
        "tokens_per_s": run.tokens_per_s,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "target_forwards_per_token": s.target_forwards / s.generated_tokens,
        "speedup": speedup,
        "output_equals_plain": equals_plain,
    }


def run_speculative_bench(args: argparse.Namespace, loaded: LoadedModel) -> int:
    configs = proposers(loaded.info.num_layers, args.num_draft)
    plain_config = EngineConfig(block_size=args.block_size)
    timed_run(loaded, plain_config, _request("Hello", 4))  # warm-up
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "dtype": loaded.info.dtype,
        "new_tokens": args.new_tokens,
        "tasks": {},
    }
    for task, prompt in TASKS.items():
        request = _request(prompt, args.new_tokens)
        print(f"{task}: none", file=sys.stderr)
        plain_done, plain = timed_run(loaded, plain_config, request)
        rows = {"none": _row(plain_done, plain, 1.0, True)}
        for name, spec in configs.items():
            if spec is None:
                continue
            print(f"{task}: {name}", file=sys.stderr)
            done, run = timed_run(loaded, EngineConfig(block_size=args.block_size, speculative=spec), request)
            speedup = SpeedupResult(name, run, plain).speedup
            rows[name] = _row(done, run, speedup, done.token_ids == plain_done.token_ids)
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
