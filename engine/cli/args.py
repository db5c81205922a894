"""The CLI's shared arguments and how they become engine configs (one place for every command)."""

from __future__ import annotations

import argparse


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
        default="auto",
        metavar="NAME",
        help="weight scheme (see `quant-report --list`): auto = a GGUF's own blocks ('native'), else "
        "'none' (the load dtype); 'none' on a GGUF is its dequantized twin",
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
