"""The headless CLI: `python -m engine generate|chat|inspect-model|bench|models`.

It is the app's scripted face and the test contract: every figure it prints comes from the same
engine the window drives. Errors print one clear line to stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.cli import models as cli_models
from engine.cli import physics as cli_physics
from engine.cli import quant as cli_quant
from engine.cli import score as cli_score
from engine.cli import serve as cli_serve
from engine.cli.args import (
    MODEL_HELP,
    add_engine_args,
    add_gguf_file_arg,
    add_group_args,
    add_model_args,
    add_sampling_args,
)
from engine.config import ConfigError
from engine.errors import ModelLoadError
from engine.hub.online import offline_by_default  # noqa: E402 - before anything imports huggingface_hub

offline_by_default()  # loads never download; `models` goes online for the request the user makes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXIT_BAD_INPUT = 2
EXIT_REQUEST_FAILED = 1


def build_parser(prog: str = "python -m engine") -> argparse.ArgumentParser:
    # prog: the frozen app runs these commands as `kvscope generate ...` (app/main.py).
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
    i.add_argument("source", help=MODEL_HELP)
    add_gguf_file_arg(i)
    i.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    i.add_argument("--context", type=int, default=None)
    i.add_argument("--budget-gib", type=float, default=None)
    i.add_argument("--json", action="store_true")

    b = sub.add_parser(
        "bench", help="native / fp32 / int8 / int4, generate() and llama.cpp, interleaved in one run"
    )
    b.add_argument("--paths", default=None, metavar="LIST", help="e.g. native,fp32,generate (default: all)")
    b.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary")
    add_model_args(b)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="a synthetic prompt of N tokens (llama-bench's -p N) instead of the chat prompt",
    )
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
    b.add_argument(
        "--grammar",
        action="store_true",
        help="constrained decoding: the grammar stage's time per token against ITL, with and without a schema",
    )
    b.add_argument(
        "--grammar-libraries",
        action="store_true",
        help="with --grammar: llguidance against xgrammar (if installed) on the model's vocabulary",
    )
    b.add_argument(
        "--verify-models",
        type=lambda text: [s for s in text.split(",") if s],
        default=None,
        metavar="LIST",
        help="--speculation: also time the verify step on these models (e.g. a 1.7B-shaped .gguf)",
    )
    b.add_argument(
        "--speculation-parts",
        default="verify,tasks",
        metavar="LIST",
        help="--speculation: verify (the verify step vs a decode step), tasks (the proposers vs plain)",
    )
    b.add_argument("--draft-model", default=None, help="--speculation: also a draft model of the family")
    b.add_argument(
        "--adaptive-draft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--speculation: draft lengths adapt per sequence (default) or stay at --num-draft",
    )
    b.add_argument(
        "--serve-load",
        action="store_true",
        help="a load run against the HTTP server: clients dropping, cancelling, n > 1; lost, mixed up, "
        "leaked blocks, RSS drift, TTFT and ITL (engine/serve/load.py)",
    )
    b.add_argument("--duration", type=int, default=600, help="seconds of --serve-load (default 600)")
    b.add_argument("--clients", type=int, default=64, help="concurrent clients of --serve-load")
    b.add_argument("--max-num-seqs", type=int, default=8, help="sequences batched per step (--serve-load)")
    b.add_argument("--seed", type=int, default=0, help="the prompts and choices of --serve-load")
    b.add_argument("--json", action="store_true")

    cli_quant.add_commands(sub)
    cli_models.add_commands(sub)
    cli_serve.add_command(sub)
    cli_score.add_command(sub)
    return parser


def command_names() -> tuple[str, ...]:
    """The subcommands (generate, chat, ...): the app hands a command line starting with one here."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return tuple(subcommands.choices)


def main(argv: list[str] | None = None, prog: str = "python -m engine") -> int:
    args = build_parser(prog).parse_args(argv)

    try:
        _name_the_gguf_file(args)
        if args.command in cli_physics.COMMANDS:
            return cli_physics.run(args)
        if args.command == "generate":
            # torch and the model code: imported by the command that runs, not by `--help`
            from engine.cli.generate import run_generate

            return run_generate(args)
        if args.command == "chat":
            # torch and the model code: imported by the command that runs, not by `--help`
            from engine.cli.generate import run_chat

            return run_chat(args)
        if args.command == "inspect-model":
            return run_inspect(args)
        if args.command == "bench" and args.serve_load:
            from engine.serve.load import run_serve_load  # the server's packages: this command only

            return run_serve_load(args)
        if args.command == "bench":
            # torch and the model code: imported by the command that runs, not by `--help`
            from engine.bench.bench import run_bench

            return run_bench(args)
        if args.command == "models":
            return cli_models.run(args)
        if args.command == "serve":
            return cli_serve.run(args)
        if args.command == "quant-report":
            return cli_quant.run(args)
        if args.command == "score":
            return cli_score.run(args)
    except (ConfigError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return EXIT_BAD_INPUT


def _name_the_gguf_file(args: argparse.Namespace) -> None:
    """`--model REPO --gguf-file FILE` (or inspect-model's source) becomes the source `REPO:FILE`."""
    # the model floor (huggingface_hub behind it): not imported by `--help`
    from engine.model.sources import with_gguf_file

    gguf_file = getattr(args, "gguf_file", None)
    if gguf_file:
        key = "source" if args.command == "inspect-model" else "model"
        setattr(args, key, with_gguf_file(getattr(args, key), gguf_file))


def run_inspect(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.model.inspect import inspect_model

    report = inspect_model(args.source, dtype=args.dtype, context=args.context, budget_gib=args.budget_gib)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    return 0
