"""`python -m engine quant-report`: what each quantization scheme buys and costs on one model,
measured in one run. Per scheme: weight bytes, load + quantize time, prefill and decode speed
through the engine (interleaved round-robin across schemes so machine drift hits all alike),
and quality on the shipped evaluation text against the unquantized model (mean/max KL, top-1
agreement, perplexity), each layer's output error against its unquantized twin, greedy
agreement of a generated reply, and top-1 agreement along the reference's reply (same context
for both). `--list` says which schemes can run here and why not. A scheme whose figures are bad is reported with them, never dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import TYPE_CHECKING, Any

from engine.cli.args import add_model_args
from engine.config import KV_DTYPES, ConfigError, EngineConfig, ModelSpec, SamplingParams
from engine.errors import ModelLoadError
from engine.events import RequestFailed, RequestFinished
from engine.request import Request
from engine.units import tokens_per_s

if TYPE_CHECKING:
    from engine.events import RequestFinished
    from engine.model.loaded import LoadedModel
    from engine.quant.schemes import SchemeStatus
    from engine.results import QualityReport

Row = dict[str, Any]  # one scheme's JSON-ready figures

SCOPE = "Every scheme quantizes the decoder's linear layers; embeddings and the LM head keep the load dtype."
REPORT_PROMPT = "Give three practical tips for keeping a houseplant alive, one sentence each."


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    q = sub.add_parser("quant-report", help="memory, speed and quality of each quantization scheme")
    add_model_args(q)
    q.add_argument("--schemes", default=None, metavar="LIST", help="comma-separated (default: all)")
    q.add_argument("--list", action="store_true", help="only list the schemes and whether they run here")
    q.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="KV cache storage for all")
    q.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per decode measurement")
    q.add_argument("--rounds", type=int, default=2, help="speed rounds per scheme (median reported)")
    q.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.measure.device import resolve_device
    from engine.quant.schemes import scheme_statuses

    # --list explains a device that is not usable here (every scheme says why) instead of refusing it
    device = args.device if args.list and args.device != "auto" else resolve_device(args.device)
    statuses = scheme_statuses(device)
    if args.list:
        return _print_list(statuses, args.json)
    if args.new_tokens < 2 or args.rounds < 1:
        raise ConfigError("--new-tokens must be >= 2 and --rounds >= 1")
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.model.sources import resolve_source

    names = _chosen(args.schemes, statuses, resolve_source(args.model).gguf is not None)
    report = build_report(args, names, statuses)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _chosen(schemes: str | None, statuses: list[SchemeStatus], is_gguf: bool) -> list[str]:
    """Requested names, checked: an unknown or unavailable scheme is an error, not skipped. By
    default every scheme that applies ('native' only to a GGUF source)."""
    # gguf: only once a GGUF file is read
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.model.gguf_native import NATIVE
    from engine.quant.schemes import NONE, QuantizationError, get_scheme

    if schemes is None:
        names = [s.name for s in statuses if s.name != "auto" and (s.name != NATIVE or is_gguf)]
    else:
        names = [n.strip() for n in schemes.split(",") if n.strip()]
        by_name = {s.name: s for s in statuses}
        for name in names:
            get_scheme(name)
            if not by_name[name].available:
                raise QuantizationError(
                    f"The quantization scheme '{name}' is unavailable: {by_name[name].reason}."
                )
    return [NONE] + [n for n in dict.fromkeys(names) if n != NONE]  # the reference comes first


def _print_list(statuses: list[SchemeStatus], as_json: bool) -> int:
    rows = [
        {"name": s.name, "available": s.available, "reason": s.reason, "description": s.description}
        for s in statuses
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<18} {'yes' if r['available'] else 'NO ':<4} {r['reason']}")
        print(f"\n{SCOPE}")
    return 0


def build_report(args: argparse.Namespace, names: list[str], statuses: list[SchemeStatus]) -> dict[str, Any]:
    # torch and the model code: imported by the command that runs, not by `--help`
    import torch

    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.bench.quality import (
        compare_logits,
        eval_token_ids,
        layer_output_errors,
    )

    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.model.loading import load_model
    from engine.model.logits import teacher_forced_logits

    status = {s.name: s for s in statuses}

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    rows: list[Row] = []
    runs: list[tuple[Row, _SpeedRun]] = []
    reference: LoadedModel | None = None
    eval_ids: list[int] | None = None
    ref_logits: torch.Tensor | None = None
    for name in names:
        row: Row = {"scheme": name, "available": status[name].available, "reason": status[name].reason}
        rows.append(row)
        if not row["available"]:
            continue
        say(f"loading {name}")
        try:
            loaded = load_model(ModelSpec(args.model, args.dtype, args.device, quantization=name))
        except ModelLoadError as exc:
            if name == "none":
                raise  # without the reference nothing can be compared
            row["error"] = str(exc)  # shown in the table, not hidden: the others still run
            continue
        if reference is None:
            reference, eval_ids = loaded, eval_token_ids(loaded.tokenizer)
            ref_logits = teacher_forced_logits(reference.model, eval_ids)
        assert eval_ids is not None and ref_logits is not None, "they come with the reference"
        say(f"quality of {name} on the evaluation text")
        quality = compare_logits(
            ref_logits,
            teacher_forced_logits(loaded.model, eval_ids, loaded.kv_dtype_for(args.kv_dtype)),
            eval_ids,
        )
        _fill_load_and_quality(row, loaded, reference, quality)
        row["kv_stored_as"] = loaded.info.kv_stored_as(args.kv_dtype)  # the pool the quality ran with
        errors = layer_output_errors(reference.model, loaded.model)
        row["layer_error_median"] = statistics.median(errors.values())
        row["layer_error_max"] = max(errors.values())
        runs.append((row, _SpeedRun(loaded, args)))
    for r in range(args.rounds):
        order = runs if r % 2 == 0 else runs[::-1]  # alternate the order to cancel drift
        for row, speed in order:
            say(f"speed round {r + 1}/{args.rounds}: {row['scheme']}")
            try:
                speed.measure()
            except Exception as exc:  # noqa: BLE001 - a scheme whose kernels fail is a finding
                row["error"] = f"generation failed: {type(exc).__name__}: {exc}"
    runs = [(row, speed) for row, speed in runs if "error" not in row]
    ref_ids = runs[0][1].output_ids if runs and runs[0][0]["scheme"] == "none" else None
    for row, speed in runs:
        speed.fill(row, ref_ids)
    if ref_ids is not None:
        say("top-1 agreement along the reference reply")
        _reply_top1_agreement(runs, ref_ids, args.kv_dtype)
    if runs and "decode_tok_s" in runs[0][0]:
        base = runs[0][0]
        for row, _ in runs:
            row["decode_speed_vs_none"] = row["decode_tok_s"] / base["decode_tok_s"]
            row["prefill_speed_vs_none"] = row["prefill_tok_s"] / base["prefill_tok_s"]
    info = reference.info if reference else None
    return {
        "model": info.name if info else args.model,
        "dtype": args.dtype,
        "device": str(reference.device) if reference else args.device,
        "threads": torch.get_num_threads(),
        "kv_dtype": args.kv_dtype,
        "eval_tokens": len(eval_ids) if eval_ids else 0,
        "prompt": REPORT_PROMPT,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        # quality compares with 'none' on a full-precision KV cache; greedy replies compare with
        # the 'none' row's reply, which used the same KV dtype as every other row
        "scope": SCOPE,
        "quality_reference": "none, KV in the load dtype",
        "layer_error": "relative L2 error of each decoder linear's output vs the 'none' layer, "
        "on a fixed standard-normal input (median and max over the layers)",
        "greedy_reference": f"none, KV {args.kv_dtype}",
        "schemes": rows,
    }


def _reply_top1_agreement(
    runs: list[tuple[Row, _SpeedRun]], reference_reply: list[int], kv_dtype: str
) -> None:
    """Greedy replies part ways at the first near-tie and are incomparable after it. This asks
    instead, at every position of the reference reply (same context for both): would the
    scheme have picked the reference's token?"""
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.bench.quality import compare_logits
    from engine.model.logits import teacher_forced_logits

    reference_engine = runs[0][1].engine
    prompt = reference_engine.prompt_ids(Request.chat(REPORT_PROMPT))
    context = prompt + reference_reply
    ref_logits = teacher_forced_logits(reference_engine.loaded.model, context)
    for row, speed in runs:
        loaded = speed.engine.loaded
        logits = teacher_forced_logits(loaded.model, context, loaded.kv_dtype_for(kv_dtype))
        agree = compare_logits(ref_logits, logits, context).top1_agree[len(prompt) - 1 :]
        row["reply_top1_agreement"] = sum(agree) / len(agree)


def _fill_load_and_quality(
    row: Row, loaded: LoadedModel, reference: LoadedModel, quality: QualityReport
) -> None:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.quant.base import quantized_layer_count
    from engine.quant.schemes import quantization_of

    record = quantization_of(loaded.model)
    row["weight_bytes"] = loaded.info.weight_bytes
    row["weight_bytes_vs_none"] = loaded.info.weight_bytes / reference.info.weight_bytes
    row["quantized_layers"] = record.quantized_layers if record else quantized_layer_count(loaded.model)
    row["load_s"] = loaded.info.load_seconds  # weights read + quantization
    row["quantize_s"] = record.seconds if record else 0.0
    row["mean_kl"] = quality.mean_kl
    row["max_kl"] = quality.max_kl
    row["top1_agreement"] = quality.top1_agreement
    row["perplexity"] = quality.quantized_perplexity
    row["perplexity_none"] = quality.reference_perplexity


class _SpeedRun:
    """One scheme's engine answering the report prompt greedily: prefill speed from its time to
    first token, decode speed from the gaps between the tokens that follow."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace):
        # torch and the model code: imported by the command that runs, not by `--help`
        from engine.core.llm_engine import LLMEngine

        self.new_tokens = args.new_tokens
        spec = ModelSpec(args.model, args.dtype, args.device)
        blocks = (args.new_tokens + 256) // 16 + 1  # the chat-templated prompt is under 256 tokens
        config = EngineConfig(
            model=spec, num_blocks=blocks, kv_dtype=args.kv_dtype, enable_prefix_caching=False
        )
        self.engine = LLMEngine(loaded, config)
        self.prefill_tok_s: list[float] = []
        self.decode_tok_s: list[float] = []
        self.output_ids: list[int] = []
        self.text = ""
        self._request(2)  # warm-up: first-call allocations, lazy imports

    def _request(self, new_tokens: int) -> RequestFinished:
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        (end,) = self.engine.run([Request.chat(REPORT_PROMPT, sampling=params)])
        if isinstance(end, RequestFailed):
            raise RuntimeError(end.message)
        return end

    def measure(self) -> None:
        reply = self._request(self.new_tokens)
        self.prefill_tok_s.append(tokens_per_s(reply.stats.prompt_tokens, reply.stats.ttft_s))
        self.decode_tok_s.append(reply.stats.tokens_per_s)
        self.output_ids, self.text = list(reply.token_ids), reply.text

    def fill(self, row: Row, reference_ids: list[int] | None) -> None:
        # torch and the model code: imported by the command that runs, not by `--help`
        from engine.bench.quality import greedy_agreement

        row["prefill_tok_s"] = statistics.median(self.prefill_tok_s)
        row["decode_tok_s"] = statistics.median(self.decode_tok_s)
        if reference_ids is not None:
            agreement = greedy_agreement(reference_ids, self.output_ids)
            row["greedy_prefix_match"] = agreement.prefix_fraction
            row["greedy_position_match"] = agreement.position_fraction
        row["reply"] = self.text


def _table(report: dict[str, Any]) -> str:
    head = (
        f"{report['model']} {report['dtype']} on {report['device']}, {report['threads']} threads, KV "
        f"{report['kv_dtype']}; quality on {report['eval_tokens']} eval tokens vs 'none'; "
        f"decode {report['new_tokens']} greedy tokens, median of {report['rounds']} rounds"
    )
    cols = (
        f"{'scheme':<18}{'MiB':>8}{'load s':>8}{'prefill/s':>10}{'decode/s':>10}{'layer err':>10}"
        f"{'mean KL':>10}{'top-1':>7}{'ppl':>10}{'greedy':>8}{'reply top-1':>12}"
    )
    lines = [head, SCOPE, cols]
    for r in report["schemes"]:
        if not r["available"]:
            lines.append(f"{r['scheme']:<18}  unavailable: {r['reason']}")
            continue
        if "error" in r:
            lines.append(f"{r['scheme']:<18}  failed: {r['error']}")
            continue
        lines.append(
            f"{r['scheme']:<18}{r['weight_bytes'] / 2**20:>8.1f}{r['load_s']:>8.2f}{r['prefill_tok_s']:>10.1f}"
            f"{r['decode_tok_s']:>10.1f}{r['layer_error_max']:>10.1e}{r['mean_kl']:>10.2e}"
            f"{r['top1_agreement']:>7.1%}{r['perplexity']:>10.2f}"
            f"{r.get('greedy_prefix_match', 1.0):>8.0%}{r.get('reply_top1_agreement', 1.0):>12.0%}"
            f"  KV {r['kv_stored_as']}"
        )
    return "\n".join(lines)
