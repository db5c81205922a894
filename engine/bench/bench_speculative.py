"""`python -m engine bench --speculation`: speculative decoding against plain decoding on the
same engine, model and prompts, in one run.

1. The verify step (engine/bench/verify_step.py): a step verifying k drafts against a plain
   decode step at the same context, interleaved, on the model and on each of `--verify-models`
   (a 1.7B-shaped GGUF, say): what a verification costs beyond one row, and where; beside it
   llama.cpp's own step of as many rows at that context against its decode step (llama-bench,
   where it is built): a peer for what batched rows cost on this machine; and the roof under
   it: the least time the panel linears' k + 1 rows take, at the rate these cores multiply 16-bit
   pairs (measured) and no less than one row's, and what that alone makes of the step against a
   plain one.
2. Tasks: a repeat-this-text task (where n-gram lookup shines) and free chat over several prompts,
   for the n-gram and the self-draft proposers (and a draft model with `--draft-model`), each
   against plain decoding, interleaved request by request (a prompt through plain, ngram and self,
   the next prompt in another order), greedy, each reply ending where the model ends its turn (or
   at --new-tokens): what a user waits for. Each method answers on one engine kept across its
   replies, as the app's is (its draft tuner learns from one reply to the next). (With EOS ignored
   the repeat task went on past the model's end of turn into chat-template text, ~a fifth of its
   tokens, which no reply shows and where a lookup in the prompt has nothing to find.) Greedy,
   every method makes plain decoding's tokens. Reported per method: decode tokens/s (from a reply's
   first token to its last) and the speedup (over plain's, medians of the rounds; also from
   submission to the last token, the prompt's prefill included, which speculation does not change),
   the share of drafts accepted, target forwards per token, the saving per token the engine
   measured, and whether every prompt's greedy text equals plain greedy decoding's.
Speedups below 1 are reported as they are; with adaptive draft lengths (the default) a proposer
that does not pay should sit near 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from engine.bench.llama_bench import BUILD_HINT, find_llama_bench, llama_batch_step
from engine.bench.verify_step import verify_step_cost
from engine.config import EngineConfig, ModelSpec, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.core.speedup import timed_request
from engine.model.loaded import LoadedModel
from engine.model.loading import load_model
from engine.model.sources import resolve_source
from engine.request import Request
from engine.units import tokens_per_s

PASSAGE = (
    "The lighthouse stood at the end of the long stone pier. Every night the keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, polished the great lens, and watched "
    "the beam sweep across the dark water until the first grey light of morning."
)
TASKS: dict[str, tuple[str, ...]] = {
    "repeat": (f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",),
    # fifteen prompts of several kinds: acceptance is a property of the text, and three prompts
    # (~100 distinct drafts: greedy rounds repeat them) judged a draft by those three (the
    # hidden-state draft kept 28% of its drafts on the first three and 31% on all fifteen, as int8
    # rows; 30.4% on all fifteen as Q8_0 blocks)
    "chat": (
        "What are three good habits for staying healthy? Explain each briefly.",
        "Write a short story about a robot who learns to paint.",
        "How does a refrigerator keep food cold?",
        "What is the difference between weather and climate?",
        "Give me a recipe for a simple vegetable soup.",
        "Describe a day in the life of a lighthouse keeper.",
        "How do vaccines work?",
        "What should I pack for a weekend trip to the mountains?",
        "Explain what a database index is.",
        "Write a letter to a friend who moved to another country.",
        "Why is the sky blue?",
        "What are the pros and cons of working from home?",
        "Tell me a story about a dragon and a knight.",
        "How can I improve my handwriting?",
        "What happens when you boil water at high altitude?",
    ),
}


def proposers(args: argparse.Namespace) -> dict[str, SpeculativeConfig]:
    adaptive = getattr(args, "adaptive_draft", True)
    methods = {
        "ngram": SpeculativeConfig("ngram", num_draft=args.num_draft, adaptive=adaptive),
        "self": SpeculativeConfig("self", num_draft=args.num_draft, adaptive=adaptive),
    }
    if getattr(args, "draft_model", None):
        methods["draft"] = SpeculativeConfig(
            "draft", num_draft=args.num_draft, draft_model=args.draft_model, adaptive=adaptive
        )
    return methods


def _request(prompt: str, new_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    return Request.chat(prompt, sampling=params)


def run_tasks(
    loaded: LoadedModel, args: argparse.Namespace, configs: dict[str, SpeculativeConfig]
) -> dict[str, Any]:
    """Every method on every task's prompts, `args.rounds` rounds, interleaved request by request
    (each prompt through every method in turn). Each method runs a task on one engine, kept from
    reply to reply as the app and the server keep theirs: its draft tuner carries what it measured
    (a step's cost by rows, the engine's acceptance) into the next reply, as in a conversation. (A
    fresh engine per reply, as earlier versions ran, relearned both at every reply's start: the
    first reply of a session, every time.)"""
    names = ["none", *configs]
    report: dict[str, Any] = {}
    for task, prompts in TASKS.items():
        engines = {
            name: LLMEngine(
                loaded,
                EngineConfig(
                    block_size=args.block_size,
                    speculative=None if name == "none" else configs[name],
                    enable_prefix_caching=False,  # every round prefills its prompts again, alike
                ),
            )
            for name in names
        }
        for engine in engines.values():  # one-off costs (first kernels, a self-draft's calibration)
            timed_request(engine, _request("Hello", 4))
        requests = [_request(p, args.new_tokens) for p in prompts]
        # per round, seconds: "decode" from each reply's first token to its last (speculation's
        # part: the prompt's prefill is the same work with or without it), "request" from
        # submission to the last token, prefill included
        seconds: dict[str, dict[str, list[float]]] = {n: {"decode": [], "request": []} for n in names}
        tokens: dict[str, tuple[tuple[int, ...], ...]] = {}
        stats: dict[str, list[Any]] = {n: [] for n in names}  # every round's: the counts over all
        for r in range(max(1, args.rounds)):
            print(f"{task} round {r + 1}", file=sys.stderr)
            request_s = dict.fromkeys(names, 0.0)
            decode_s = dict.fromkeys(names, 0.0)
            ids: dict[str, list[tuple[int, ...]]] = {name: [] for name in names}
            # Interleaved request by request, each method in turn (the order rotating): one method's
            # 15 replies in a row took a few seconds, and the machine's memory bandwidth drifts on
            # that scale (methods that did the same work measured 0.97-1.02x between runs).
            for i, request in enumerate(requests):
                turn = (r + i) % len(names)
                for name in names[turn:] + names[:turn]:
                    done, run = timed_request(engines[name], request)
                    request_s[name] += run.seconds
                    decode_s[name] += max(0.0, run.seconds - done.stats.ttft_s)
                    ids[name].append(done.token_ids)
                    stats[name].append(done.stats)
            for name in names:
                seconds[name]["request"].append(request_s[name])
                seconds[name]["decode"].append(decode_s[name])
                tokens.setdefault(name, tuple(ids[name]))

        # a method whose text differed made other tokens: each rate counts its own
        made = {name: sum(len(t) for t in tokens[name]) for name in names}
        rate = {  # (the decode phase makes every token but each reply's first)
            name: {
                "decode": tokens_per_s(
                    made[name] - len(requests), statistics.median(seconds[name]["decode"])
                ),
                "request": tokens_per_s(made[name], statistics.median(seconds[name]["request"])),
            }
            for name in names
        }
        rows = {}
        for name in names:
            plain = rate["none"]
            rows[name] = {
                "tokens_per_s": rate[name]["decode"],
                "speedup": rate[name]["decode"] / plain["decode"] if plain["decode"] else 0.0,
                "request_tokens_per_s": rate[name]["request"],
                "request_speedup": rate[name]["request"] / plain["request"] if plain["request"] else 0.0,
                "rounds_s": seconds[name]["decode"],
                **_figures(stats[name]),
                "output_equals_plain": tokens[name] == tokens["none"],
            }
        report[task] = rows
    return report


def _figures(stats: list[Any]) -> dict[str, float]:
    drafted = sum(s.spec_drafted for s in stats)
    generated = sum(s.generated_tokens for s in stats)
    return {
        "drafts_proposed": drafted,
        "drafts_accepted": sum(s.spec_accepted for s in stats),
        "acceptance_rate": sum(s.spec_accepted for s in stats) / drafted if drafted else 0.0,
        "target_forwards_per_token": sum(s.target_forwards for s in stats) / max(1, generated),
        "saved_ms_per_token": 1e3 * sum(s.spec_saved_s for s in stats) / max(1, generated),
    }


def run_speculative_bench(args: argparse.Namespace, loaded: LoadedModel) -> int:
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "quantization": loaded.info.quantization,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "num_draft": args.num_draft,
    }
    parts = set((getattr(args, "speculation_parts", None) or "verify,tasks").split(","))
    if "verify" in parts:
        llama_bench = find_llama_bench(getattr(args, "llama_bench", None))
        print("verify step: this model", file=sys.stderr)
        steps = [verify_step_cost(loaded, k=args.num_draft)]
        for source in getattr(args, "verify_models", None) or ():
            print(f"verify step: {source}", file=sys.stderr)
            other = load_model(ModelSpec(source, device=args.device))
            steps.append(verify_step_cost(other, k=args.num_draft))
            del other
            gc.collect()
        for step, source in zip(steps, [args.model, *(getattr(args, "verify_models", None) or ())]):
            step["llama_cpp"] = _llama_verify(llama_bench, source, step)
        report["verify_step"] = steps
    if "tasks" in parts:
        configs = proposers(args)
        report["tasks"] = run_tasks(loaded, args, configs)
        report["greedy_equals_plain"] = all(
            row["output_equals_plain"] for rows in report["tasks"].values() for row in rows.values()
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(_table(report))
    return 0


def _llama_verify(binary: Path | None, source: str, step: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own step of as many rows at the same context against its decode step, on the
    same file and threads (a peer for the verify row: what its batched rows cost it)."""
    if binary is None:
        return {"skipped": BUILD_HINT}
    gguf = resolve_source(source).gguf
    if gguf is None:
        return {"skipped": "the model is not a GGUF file"}
    try:
        rows = step["drafts"] + 1
        return llama_batch_step(binary, gguf, rows, step["context_tokens"], torch.get_num_threads())
    except (RuntimeError, KeyError, ValueError) as exc:
        return {"skipped": f"llama-bench: {exc}"}


def _table(report: dict[str, Any]) -> str:
    lines = [f"{report['model']} ({report['quantization']}), {report['threads']} threads"]
    for step in report.get("verify_step", []):
        ratio = step["verify_vs_plain"]
        lines.append(
            f"verify step, {step['drafts']} drafts, {step['model']}: {step['verify']['step_ms']:.1f} ms vs "
            f"plain {step['plain']['step_ms']:.1f} ms = {ratio['step']:.2f}x (forward {ratio['forward']:.2f}x)"
        )
        peer = step.get("llama_cpp", {})
        if "rows_ms" in peer:
            lines.append(
                f"    llama.cpp, same rows and context: {peer['rows_ms']:.1f} ms vs {peer['one_row_ms']:.1f} ms "
                f"= {peer['rows_vs_one_row']:.2f}x"
            )
        elif "skipped" in peer:
            lines.append(f"    llama.cpp: {peer['skipped']}")
        roof = step.get("roof", {})
        if "floor_vs_plain" in roof:
            lines.append(
                f"    roof: {roof['rows']} rows of the panel linears take >= {roof['compute_floor_ms']:.1f} ms at "
                f"this CPU's 16-bit pair products ({roof['pair_products_per_s'] / 1e9:.0f} G/s, measured) and >= one "
                f"row's {roof['one_row_linears_ms']:.1f} ms: >= {roof['floor_vs_plain']:.2f}x a plain step if nothing "
                f"else grew; ours ran at {roof['verify_linears_products_per_s'] / roof['pair_products_per_s']:.0%} "
                "of that rate"
            )
        elif "skipped" in roof:
            lines.append(f"    roof: {roof['skipped']}")
        for name, split in step["split_ms"].items():
            lines.append(
                "    "
                + f"{name:6} "
                + "  ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in split.items())
                + " ms"
            )
    for task, rows in report.get("tasks", {}).items():
        lines.append(f"{task}:")
        for name, row in rows.items():
            lines.append(
                f"  {name:6} {row['tokens_per_s']:7.2f} tok/s  speedup {row['speedup']:.2f} "
                f"(whole request {row['request_speedup']:.2f})  "
                f"acceptance {row['acceptance_rate']:.0%} of {row['drafts_proposed']}  "
                f"forwards/token {row['target_forwards_per_token']:.2f}  "
                f"saved {row['saved_ms_per_token']:+.2f} ms/token  "
                f"same text: {'yes' if row['output_equals_plain'] else 'NO'}"
            )
    return "\n".join(lines)
