"""The CLI's shared arguments and how they become engine configs (one place for every command)."""

from __future__ import annotations

import argparse
import json

from engine.config import (
    DRY_DEFAULT_BREAKERS,
    KV_DTYPES,
    ConfigError,
    EngineConfig,
    GrammarSpec,
    ModelSpec,
    SamplingParams,
    SpeculativeConfig,
)
from engine.grammar.compile import GrammarError, check

MODEL_HELP = (
    "'default', an HF folder, a .gguf file, or a repo id in the local Hugging Face cache (a GGUF "
    "repo's one .gguf file; REPO:FILE picks one of several)"
)


def add_gguf_file_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gguf-file",
        default=None,
        metavar="FILE",
        help="with a repo id as the model: which of its .gguf files",
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help=MODEL_HELP)
    add_gguf_file_arg(p)
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
        help="speculative decoding: n-gram prompt lookup, a draft model, or the target drafting for itself (from its hidden state or its first layers)",
    )
    p.add_argument("--draft-model", default=None, help="draft model source for --speculative draft")
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per speculative round")
    p.add_argument(
        "--self-draft-layers",
        type=int,
        default=None,
        help="--speculative self: the target's first N layers draft, or 0: its hidden state "
        "(default: the calibration's choice)",
    )
    p.add_argument(
        "--adaptive-draft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each sequence's draft length adapts to its recent acceptance and the measured costs, "
        "down to none (default); --no-adaptive-draft keeps --num-draft",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        metavar="NAME",
        help="weight scheme (see `quant-report --list`): auto = a GGUF's own blocks ('native'), else "
        "'none' (the load dtype); 'none' on a GGUF is its dequantized twin",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="KV cache storage (auto = the model dtype; float16 for a GGUF at its own bits)",
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
    p.add_argument(
        "--typical-p",
        type=float,
        default=1.0,
        help="typical sampling: keep this mass of typical tokens (1 = off)",
    )
    p.add_argument(
        "--dry-multiplier",
        type=float,
        default=0.0,
        help="DRY: penalty on continuing a repeated sequence (0 = off)",
    )
    p.add_argument(
        "--dry-base", type=float, default=1.75, help="DRY: penalty growth per extra repeated token"
    )
    p.add_argument("--dry-allowed-length", type=int, default=2, help="DRY: repeats this long are free")
    p.add_argument(
        "--dry-penalty-last-n",
        type=int,
        default=0,
        help="DRY: look this many tokens back (0 = the whole text)",
    )
    p.add_argument(
        "--dry-sequence-breaker",
        action="append",
        default=None,
        metavar="TEXT",
        help='DRY: a string that ends a repeated sequence (repeatable; default \\n : " *)',
    )
    p.add_argument(
        "--xtc-threshold", type=float, default=0.1, help="XTC: tokens this likely or more are top choices"
    )
    p.add_argument(
        "--xtc-probability", type=float, default=0.0, help="XTC: chance per token of excluding them (0 = off)"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    p.add_argument(
        "--ban-token", action="append", type=int, default=[], metavar="ID", help="never draw token ID"
    )
    add_grammar_args(p)


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """Constrained decoding: at most one grammar, its token mask the sampler's first stage."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema", metavar="FILE", default=None, help="the reply is JSON valid under this schema"
    )
    g.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    g.add_argument("--regex", metavar="R", default=None, help="the reply matches this regular expression")
    g.add_argument(
        "--grammar", metavar="FILE", default=None, help="the reply follows this Lark or GBNF (.gbnf) grammar"
    )
    g.add_argument(
        "--choice",
        metavar="TEXT",
        action="append",
        default=None,
        help="the reply is one of these (repeatable)",
    )


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{flag}: cannot read {path}: {reason}") from None


def grammar_kind_of(path: str, text: str) -> str:
    """A grammar file's kind: GBNF by its extension or its `::=` rules, else Lark."""
    if path.endswith(".gbnf") or (not path.endswith(".lark") and "::=" in text):
        return "gbnf"
    return "lark"


def grammar_from(args: argparse.Namespace) -> GrammarSpec | None:
    """The grammar the flags ask for, compiled once here so that a bad one is refused before
    the model loads (ConfigError with the flag and the reason)."""
    if getattr(args, "json_schema", None):
        flag, spec = "--json-schema", GrammarSpec("json_schema", _read(args.json_schema, "--json-schema"))
    elif getattr(args, "json_object", False):
        flag, spec = "--json-object", GrammarSpec("json_object")
    elif getattr(args, "regex", None) is not None:
        flag, spec = "--regex", GrammarSpec("regex", args.regex)
    elif getattr(args, "grammar", None):
        text = _read(args.grammar, "--grammar")
        flag, spec = "--grammar", GrammarSpec(grammar_kind_of(args.grammar, text), text)
    elif getattr(args, "choice", None):
        flag, spec = "--choice", GrammarSpec("choice", json.dumps(args.choice))
    else:
        return None
    try:
        check(spec)
    except GrammarError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    return spec


def parse_logit_bias(items: list[str]) -> tuple[tuple[int, float], ...]:
    """['42=5', '7=-100'] -> ((42, 5.0), (7, -100.0)); a malformed item is a ConfigError."""

    pairs = []
    for item in items:
        token, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ConfigError(f"--logit-bias takes ID=BIAS, e.g. 42=5 or 42=-100, got {item!r}") from None
    return tuple(pairs)


def sampling_from(args: argparse.Namespace, snapshot_top_n: int = 0) -> SamplingParams:
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
        typical_p=args.typical_p,
        dry_multiplier=args.dry_multiplier,
        dry_base=args.dry_base,
        dry_allowed_length=args.dry_allowed_length,
        dry_penalty_last_n=args.dry_penalty_last_n,
        dry_sequence_breakers=(
            DRY_DEFAULT_BREAKERS if args.dry_sequence_breaker is None else tuple(args.dry_sequence_breaker)
        ),
        xtc_threshold=args.xtc_threshold,
        xtc_probability=args.xtc_probability,
        logit_bias=parse_logit_bias(args.logit_bias),
        banned_token_ids=tuple(args.ban_token),
        # generate only: parallel samples / beam search (chat replies one sequence at a time)
        n=getattr(args, "n", 1),
        num_beams=getattr(args, "num_beams", 1),
        length_penalty=getattr(args, "length_penalty", 1.0),
        early_stopping=EARLY_STOPPING_WORDS[getattr(args, "early_stopping", "false")],
        grammar=grammar_from(args),
    )


EARLY_STOPPING_WORDS: dict[str, bool | str] = {"true": True, "false": False, "never": "never"}


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


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
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


def speculative_from(args: argparse.Namespace) -> SpeculativeConfig | None:
    if not args.speculative:
        return None
    return SpeculativeConfig(
        args.speculative,
        num_draft=args.num_draft,
        draft_model=args.draft_model,
        self_draft_layers=args.self_draft_layers,
        adaptive=args.adaptive_draft,
    )
