"""`python -m engine roofline|sweep`: the physics of inference on this machine, measured.

roofline: the device's measured limits (matmul peak, memory bandwidth, ridge point) and where the
model's prefill and decode steps land against them: FLOPs, bytes, intensity, MFU, MBU.
sweep: TTFT against prompt length and ITL against context length, per dtype, interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.cli.args import add_model_args
from engine.config import ConfigError, ModelSpec
from engine.units import si

COMMANDS = ("roofline", "sweep")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return values


def _dtype_list(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    bad = [v for v in values if v not in DTYPE_CHOICES]
    if not values or bad:
        raise argparse.ArgumentTypeError(
            f"expected dtypes from {', '.join(DTYPE_CHOICES)} separated by commas, got {text!r}"
        )
    return values


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = subparsers.add_parser(
        "roofline", help="measured device limits and where prefill and decode steps sit against them"
    )
    add_model_args(r)
    r.add_argument("--refresh", action="store_true", help="re-measure the device limits (else cached)")
    r.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the prefill step")
    r.add_argument("--decode-steps", type=int, default=16, help="decode steps measured per batch size")
    r.add_argument("--rounds", type=int, default=2, help="runs of the scenario; each point keeps its fastest")
    r.add_argument(
        "--batch-sizes", type=_int_list, default=[1, 4], metavar="LIST", help="e.g. 1,4,8 (default 1,4)"
    )
    r.add_argument("--json", action="store_true")

    s = subparsers.add_parser("sweep", help="TTFT vs prompt length and ITL vs context length, per dtype")
    s.add_argument(
        "--model", default="default", help="'default', an HF folder, a .gguf file or a cached repo id"
    )
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument(
        "--dtypes",
        type=_dtype_list,
        default=["float32", "bfloat16"],
        metavar="LIST",
        help="compared in one run, interleaved; ratios are to the first (default float32,bfloat16)",
    )
    s.add_argument("--prompt-lengths", type=_int_list, default=[32, 128, 512], metavar="LIST")
    s.add_argument("--context-lengths", type=_int_list, default=[128, 512, 1024], metavar="LIST")
    s.add_argument("--decode-tokens", type=int, default=8, help="decode steps timed per context length")
    s.add_argument("--repeats", type=int, default=2, help="runs per length and dtype (median reported)")
    s.add_argument(
        "--attention-kernels",
        action="store_true",
        help="instead: SDPA's math kernel against its flash kernel on prefills of growing length "
        "(time, peak memory, the score matrix only math allocates); --prompt-lengths sets the lengths",
    )
    s.add_argument("--json", action="store_true")


def _progress(message: str) -> None:
    print(message, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.command == "roofline":
        return run_roofline(args)
    return run_sweep(args)


def run_roofline(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.bench.sweep import measure_roofline_points
    from engine.measure.device_limits import load_or_measure
    from engine.model.loading import load_model

    loaded = load_model(ModelSpec(args.model, dtype=args.dtype, device=args.device))
    _progress("device limits (measured once per device and dtype, then cached)")
    limits = load_or_measure(loaded.device, args.dtype, refresh=args.refresh)
    points = measure_roofline_points(
        loaded,
        limits,
        args.prompt_tokens,
        args.decode_steps,
        args.batch_sizes,
        rounds=args.rounds,
        progress=_progress,
    )
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "dtype": args.dtype,
        "device": str(loaded.device),
        "device_limits": limits.to_dict(),
        "prompt_tokens": args.prompt_tokens,
        "decode_steps": args.decode_steps,
        "rounds": args.rounds,
        "points": points,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_roofline(report)
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.bench.sweep import compare_dtypes

    if args.repeats < 1 or args.decode_tokens < 1:
        raise ConfigError("--repeats and --decode-tokens must be at least 1")
    if args.attention_kernels:
        return run_attention_kernels(args)
    report = compare_dtypes(
        args.model,
        args.dtypes,
        args.prompt_lengths,
        args.context_lengths,
        device=args.device,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        progress=_progress,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_sweep(report)
    return 0


def run_attention_kernels(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.bench.attention_kernels import compare_attention_kernels
    from engine.model.loading import load_model

    loaded = load_model(ModelSpec(args.model, dtype=args.dtypes[0], device=args.device))
    lengths = args.prompt_lengths if args.prompt_lengths != [32, 128, 512] else [256, 512, 1024, 2048]
    report = compare_attention_kernels(loaded, lengths, args.repeats, progress=_progress)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    print(
        f"{report['model']}: {report['heads']} heads x {report['layers']} layers; peak memory: {report['peak_memory_source']}"
    )
    print(f"{'prompt':>8}{'kernel':>8}{'prefill ms':>12}{'peak':>12}{'scores':>12}{'math/flash':>12}")
    for row in report["rows"]:
        peak = si(row["peak_bytes"], "B") if row["peak_bytes"] is not None else "n/a"
        ratio = f"{row['time_vs_flash']:.2f}" if "time_vs_flash" in row else ""
        print(
            f"{row['prompt_tokens']:>8}{row['kernel']:>8}{row['prefill_s'] * 1000:>12.1f}{peak:>12}"
            f"{si(row['score_matrix_bytes'], 'B'):>12}{ratio:>12}"
        )
    return 0


def _print_roofline(r: dict[str, Any]) -> None:
    lim = r["device_limits"]
    print(
        f"{r['model']} {r['dtype']} on {lim['device_name']}; each point the fastest of {r['rounds']} rounds"
    )
    print(
        f"peak {si(lim['peak_flops'], 'FLOP/s')} (matmul {lim['matmul_size']}^2), bandwidth "
        f"{si(lim['bandwidth'], 'B/s')}, ridge {lim['ridge_flops_per_byte']:.2f} FLOP/B"
    )
    print(
        f"{'phase':8}{'batch':>6}{'FLOP/step':>12}{'B/step':>12}{'FLOP/B':>8}{'ms/step':>9}{'MFU':>8}{'MBU':>8}  bound"
    )
    for p in r["points"]:
        print(
            f"{p['phase']:8}{p['batch']:>6}{si(p['flops_per_step'], ''):>12}{si(p['bytes_per_step'], ''):>12}"
            f"{p['intensity']:>8.2f}{p['forward_s_per_step'] * 1000:>9.2f}{p['mfu']:>8.1%}{p['mbu']:>8.1%}  {p['bound']}"
        )


def _print_sweep(r: dict[str, Any]) -> None:
    base = r["baseline_dtype"]
    print(f"{r['model']} on {r['device']}; ratios are to {base}")
    print(f"{'dtype':10}{'prompt':>8}{'TTFT ms':>10}{'tok/s':>10}{'ratio':>8}")
    for row in r["prompt_lengths"]:
        print(
            f"{row['dtype']:10}{row['prompt_tokens']:>8}{row['ttft_s'] * 1000:>10.1f}"
            f"{row['prefill_tokens_per_s']:>10.0f}{row[f'ttft_s_vs_{base}']:>8.2f}"
        )
    print(f"{'dtype':10}{'context':>8}{'ITL ms':>10}{'tok/s':>10}{'ratio':>8}")
    for row in r["context_lengths"]:
        print(
            f"{row['dtype']:10}{row['context_tokens']:>8}{row['median_itl_s'] * 1000:>10.2f}"
            f"{row['decode_tokens_per_s']:>10.1f}{row[f'median_itl_s_vs_{base}']:>8.2f}"
        )
