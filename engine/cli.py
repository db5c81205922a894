"""The headless CLI: `python -m engine generate|chat|inspect-model|bench`.

It is the app's scripted face and the test contract: every figure it prints comes from the same
engine the window drives. Errors print one clear line to stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXIT_BAD_INPUT = 2
EXIT_REQUEST_FAILED = 1


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="'default', an HF folder, a .gguf file or a cached repo id"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-budget-mib", type=float, default=None, help="KV pool size in MiB")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the budget)"
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=None, help="max prompt tokens of one sequence per step"
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft", "self"],
        default=None,
        help="speculative decoding: n-gram prompt lookup, a draft model, or the target's first layers",
    )
    p.add_argument("--draft-model", default=None, help="draft model source for --speculative draft")
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per speculative round")
    p.add_argument("--self-draft-layers", type=int, default=None, help="layers kept by --speculative self")
    p.add_argument("--adaptive-draft", action="store_true", help="adapt the round size to recent acceptance")
    p.add_argument(
        "--quantization",
        default="none",
        metavar="NAME",
        help="weight quantization scheme (see `quant-report --list`); 'none' keeps the load dtype",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="KV cache storage (auto = the model dtype)",
    )


def add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from(args, snapshot_top_n: int = 0):
    from engine.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        snapshot_top_n=snapshot_top_n,
        # generate only: parallel samples / beam search (chat replies one sequence at a time)
        n=getattr(args, "n", 1),
        num_beams=getattr(args, "num_beams", 1),
        length_penalty=getattr(args, "length_penalty", 1.0),
        early_stopping=EARLY_STOPPING_WORDS[getattr(args, "early_stopping", "false")],
    )


EARLY_STOPPING_WORDS = {"true": True, "false": False, "never": "never"}


def add_group_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=1, help="parallel samples of the prompt, sharing its KV blocks")
    p.add_argument("--num-beams", type=int, default=1, help="beam search width (needs --temperature 0)")
    p.add_argument(
        "--length-penalty", type=float, default=1.0, help="beam score = sum of log-probs / length ** this"
    )
    p.add_argument(
        "--early-stopping",
        type=str.lower,
        choices=list(EARLY_STOPPING_WORDS),
        default="false",
        help="beam search end: true, false (transformers' heuristic) or never",
    )


def engine_config_from(args):
    from engine.config import EngineConfig, ModelSpec

    budget = int(args.kv_budget_mib * 2**20) if args.kv_budget_mib else None
    return EngineConfig(
        model=ModelSpec(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization),
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_budget_bytes=budget,
        prefill_chunk_size=args.prefill_chunk,
        enable_prefix_caching=not args.no_prefix_cache,
        kv_dtype=args.kv_dtype,
        speculative=speculative_from(args),
    )


def speculative_from(args):
    from engine.config import SpeculativeConfig

    if not args.speculative:
        return None
    return SpeculativeConfig(
        args.speculative,
        num_draft=args.num_draft,
        draft_model=args.draft_model,
        self_draft_layers=args.self_draft_layers,
        adaptive=args.adaptive_draft,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from engine import cli_physics

    cli_physics.add_commands(sub)

    g = sub.add_parser("generate", help="one reply to one prompt")
    add_engine_args(g)
    add_sampling_args(g, temperature=0.0)
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None)
    g.add_argument("--probs", type=int, default=0, metavar="K", help="record the top-K candidates per token")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_group_args(g)

    c = sub.add_parser("chat", help="interactive terminal chat")
    add_engine_args(c)
    add_sampling_args(c, temperature=0.7)
    c.add_argument("--system", default=None)

    i = sub.add_parser("inspect-model", help="shapes and memory of a model, without loading weights")
    i.add_argument("source", help="'default', an HF folder, a .gguf file or a cached repo id")
    i.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    i.add_argument("--context", type=int, default=None)
    i.add_argument("--budget-gib", type=float, default=None)
    i.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="engine vs transformers generate(), interleaved in one run")
    add_model_args(b)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument(
        "--concurrency",
        default=None,
        metavar="LIST",
        help="e.g. 1,2,4,8: continuous batching vs one-by-one at each level, and prefix-cache TTFT",
    )
    b.add_argument(
        "--speculation",
        action="store_true",
        help="speculative decoding (n-gram, self-draft) vs plain decoding on a repeat task and free chat",
    )
    b.add_argument("--num-draft", type=int, default=4, help="draft tokens per round for --speculation")
    b.add_argument("--json", action="store_true")

    from engine import cli_quant

    cli_quant.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.config import ConfigError
    from engine.loading import ModelLoadError

    try:
        from engine import cli_physics

        if args.command in cli_physics.COMMANDS:
            return cli_physics.run(args)
        if args.command == "generate":
            from engine.cli_generate import run_generate

            return run_generate(args)
        if args.command == "chat":
            from engine.cli_generate import run_chat

            return run_chat(args)
        if args.command == "inspect-model":
            return run_inspect(args)
        if args.command == "bench":
            from engine.bench import run_bench

            return run_bench(args)
        if args.command == "quant-report":
            from engine import cli_quant

            return cli_quant.run(args)
    except (ConfigError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return EXIT_BAD_INPUT


def run_inspect(args) -> int:
    from engine.model_inspect import inspect_model

    report = inspect_model(args.source, dtype=args.dtype, context=args.context, budget_gib=args.budget_gib)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    return 0
