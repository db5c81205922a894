"""`python -m engine score --text FILE`: every token of a text scored by the model (its
log-probability under the tokens before it, its rank, the likeliest tokens there) and the text's
perplexity, through the engine's paged forward (engine/core/scoring.py), as the app's scoring
view and `/v1/completions` with echo and logprobs compute them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.cli.args import add_engine_args

EXIT_BAD_INPUT = 2


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "score", help="each token's log-probability, rank and surprise in a text, and its perplexity"
    )
    add_engine_args(s)
    s.add_argument("--text", required=True, metavar="FILE", help="the text to score ('-': standard input)")
    s.add_argument("--top", type=int, default=3, metavar="K", help="the K likeliest tokens at each position")
    s.add_argument("--json", action="store_true", help="print one JSON object")


def read_text(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"no text file at {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None


def run(args: argparse.Namespace) -> int:
    try:
        text = read_text(args.text)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # torch and the model: only once the text is there to score
    from engine.cli.args import engine_config_from
    from engine.core.llm_engine import LLMEngine
    from engine.core.scoring import score_text
    from engine.errors import InspectionError
    from engine.model.loading import load_model

    config = engine_config_from(args)
    loaded = load_model(
        config.model, progress=lambda stage, fraction: print(f"[{fraction:4.0%}] {stage}", file=sys.stderr)
    )
    core = LLMEngine(loaded, config)
    try:
        score = score_text(core, text, args.top)
    except InspectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(score_json(score, loaded.info.name, loaded.info.quantization), indent=2))
        return 0
    print(f"{'token':>20} {'logprob':>9} {'rank':>7} {'surprise':>9}")
    for token in score.tokens:
        lp = "" if token.logprob is None else f"{token.logprob:9.3f}"
        rank = "" if token.rank is None else f"{token.rank:7d}"
        bits = "" if token.surprise_bits is None else f"{token.surprise_bits:7.2f} b"
        print(f"{token.text!r:>20} {lp:>9} {rank:>7} {bits:>9}")
    print(
        f"perplexity {score.perplexity:.3f} over {score.scored} tokens (log-prob {score.total_logprob:.3f}), "
        f"{score.seconds * 1000:.0f} ms"
    )
    return 0


def score_json(score: Any, model: str, scheme: str) -> dict[str, Any]:
    return {
        "model": model,
        "quantization": scheme,
        "tokens": [
            {
                "id": t.token_id,
                "text": t.text,
                "logprob": t.logprob,
                "rank": t.rank,
                "surprise_bits": t.surprise_bits,
                "top": None
                if t.top is None
                else [
                    {"id": i, "text": s, "logprob": lp}
                    for i, s, lp in zip(t.top.ids, t.top.texts, t.top_logprobs)
                ],
            }
            for t in score.tokens
        ],
        "scored": score.scored,
        "total_logprob": score.total_logprob,
        "perplexity": score.perplexity if score.scored else None,
        "seconds": score.seconds,
    }
