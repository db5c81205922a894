"""`python -m engine bench`: the engine's weight paths (the GGUF's own bits, fp32, int8 and int4
weight-only), transformers' generate() and llama.cpp's llama-bench on the same model, prompt,
new tokens and threads, interleaved round by round in one process and reported as ratios; the
split of a decode token (matmuls, attention, the rest, sampling, events); and each path's
bandwidth floor (bytes read per token / measured memory bandwidth) and MBU.

`--model FILE` with any GGUF file (a 1.7B or 8B download) compares the native engine with
llama-bench on it by default (no float32 twin of a large file is loaded): ITL, prefill of a
`--prompt-tokens` long prompt (llama-bench's -p; its decode at that depth, -d, as kvscope's follows
the prompt), load time and peak RSS side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList

from engine.bench.bench_concurrency import run_concurrency_bench
from engine.bench.bench_grammar import run_grammar_bench
from engine.bench.bench_speculative import run_speculative_bench
from engine.bench.decode_split import decode_split
from engine.bench.llama_bench import BUILD_HINT, find_llama_bench, llama_load_seconds, run_llama_bench
from engine.config import ConfigError, EngineConfig, ModelSpec, SamplingParams
from engine.core import gc_heap
from engine.core.llm_engine import LLMEngine
from engine.events import Event, TokenGenerated
from engine.measure.memory import device_name, measure_memory_bandwidth
from engine.model.loading import load_model, load_transformers_model
from engine.model.runtime_memory import cached_share
from engine.model.sources import resolve_source
from engine.request import Request
from engine.units import tokens_per_s

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.core.llm_engine import LLMEngine
    from engine.model.loaded import LoadedModel

# (TTFT, inter-token gaps, token ids: None where the path does not report them) of one run
Run = tuple[float, list[float], list[int] | None]
Report = dict[str, Any]  # JSON-ready

BENCH_PROMPT = (
    "Explain, in a few paragraphs, why the key-value cache makes autoregressive decoding of a "
    "transformer faster, and what it costs in memory as the context grows."
)


class _TokenClock(StoppingCriteria):
    """Records when generate() produced each token (it calls stopping criteria once per step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(
        self, input_ids: torch.LongTensor, scores: tuple[torch.Tensor] | None, **kwargs: Any
    ) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        # a bool tensor (torch's stubs type the legacy BoolTensor class apart from Tensor)
        return cast(
            torch.BoolTensor, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        )


def run_hf(
    model: PreTrainedModel, prompt_ids: list[int], new_tokens: int
) -> tuple[float, list[float], list[int]]:
    assert isinstance(model, GenerationMixin), "a causal LM has generate()"
    clock = _TokenClock()
    inputs = torch.tensor([prompt_ids], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    ids: list[int] = out[0, len(prompt_ids) :].tolist()
    return clock.times[0] - start, _gaps(clock.times), ids


def run_engine(
    engine: LLMEngine, prompt_ids: list[int], new_tokens: int, events: list[Event]
) -> tuple[float, list[float], list[int]]:

    events.clear()
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.run([Request(prompt_token_ids=tuple(prompt_ids), sampling=params)])
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    times = [e.t for e in tokens]
    return times[0] - start, _gaps(times), [e.token_id for e in tokens]


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _summary(ttfts: list[float], itls: list[float], per_token: bool = True) -> dict[str, float | None]:
    """Median TTFT; median and p99 ITL, and the decode rate of a typical token (1 / median ITL:
    one stall, a page fault or the OS, does not move it). `per_token` False: `itls` repeat one
    mean per run (llama-bench reports no token times), so there is no p99 to give."""
    itls_sorted = sorted(itls)
    p99 = itls_sorted[min(len(itls_sorted) - 1, int(0.99 * len(itls_sorted)))]
    median = statistics.median(itls)
    return {
        "ttft_s": statistics.median(ttfts),
        "median_itl_s": median,
        "p99_itl_s": p99 if per_token else None,
        "decode_tokens_per_s": tokens_per_s(1, median),
    }


PATHS = ("native", "fp32", "int8", "int4", "generate", "llama.cpp")
# path -> the model spec's weight scheme (generate() runs transformers' own loop on the fp32 model)
SCHEMES = {"native": "native", "fp32": "none", "int8": "int8-weight-only", "int4": "int4-weight-only"}


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM), or 0 where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def synthetic_prompt(vocab_size: int, length: int) -> list[int]:
    """`length` token ids spread over the vocabulary, the same every run (llama-bench prefills
    random tokens too: a prompt's cost does not depend on which tokens it holds)."""
    step = 7919  # a prime: the ids cycle the vocabulary
    return [(1000 + i * step) % vocab_size for i in range(length)]


def run_bench(args: argparse.Namespace) -> int:
    def progress(stage: str, f: float) -> None:
        print(f"[{f:4.0%}] {stage}", file=sys.stderr)

    try:
        if args.speculation or args.concurrency or args.grammar or args.grammar_libraries:
            spec = ModelSpec(args.model, dtype=args.dtype, device=args.device)
            loaded = load_model(spec, progress=progress)
            gc_heap.freeze()  # the heap the load leaves, out of full collections, as the service keeps it
            if args.grammar or args.grammar_libraries:
                return run_grammar_bench(args, loaded)
            if args.speculation:
                return run_speculative_bench(args, loaded)

            return run_concurrency_bench(args, loaded)
        report = bench_paths(args, progress)
        print(json.dumps(report, indent=2) if args.json else _table(report))
        return 0
    finally:
        gc_heap.thaw()  # (a bench run inside another process leaves its heap collectable)


def bench_paths(args: argparse.Namespace, progress: Callable[[str, float], None]) -> Report:
    """Every path on the same prompt, new tokens and threads, interleaved round by round."""

    gguf = resolve_source(args.model).gguf
    file_mode = gguf is not None and args.model != "default"
    default_paths = "native,llama.cpp" if file_mode else ",".join(PATHS)
    wanted = [p.strip() for p in (args.paths or default_paths).split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PATHS]
    if unknown:
        raise ConfigError(f"unknown bench path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    notes: dict[str, str] = {}
    if gguf is None:
        for path in ("native", "llama.cpp"):
            if path in wanted:
                wanted.remove(path)
                notes[path] = "skipped: the model is not a GGUF file"
    llama_bench = find_llama_bench(getattr(args, "llama_bench", None)) if "llama.cpp" in wanted else None
    if "llama.cpp" in wanted and llama_bench is None:
        wanted.remove("llama.cpp")
        notes["llama.cpp"] = BUILD_HINT

    engines: dict[str, LLMEngine] = {}
    loaded_by: dict[str, LoadedModel] = {}
    sinks: dict[str, list[Event]] = {}
    baseline: PreTrainedModel | None = None
    if "generate" in wanted:  # stock transformers: its own modules, not the engine's kernel layers
        progress("loading transformers' own model for generate()", 0.0)
        baseline = load_transformers_model(args.model, "float32")
    load_s: dict[str, float] = {}
    # the share of the file in the page cache as each load began: a cold file's load reads the disk
    cached: dict[str, float | None] = {}
    peak_rss: dict[str, int] = {}
    # the native path first: the process's peak RSS right after it is the native load's own
    order = sorted(
        [p for p in wanted if p in SCHEMES] + (["fp32"] if "generate" in wanted else []),
        key=lambda p: p != "native",
    )
    for path in order:
        if path in loaded_by:
            continue
        spec = ModelSpec(args.model, dtype="float32", device=args.device, quantization=SCHEMES[path])
        progress(f"loading {path}", 0.0)
        if gguf is not None:
            cached[path] = cached_share(gguf)
        start = time.perf_counter()
        loaded_by[path] = load_model(spec, progress=progress)
        load_s[path] = time.perf_counter() - start
        if not peak_rss:
            peak_rss[path] = peak_rss_bytes()
        # prefix caching off: every round prefills the whole prompt, as generate() and llama.cpp do
        config = EngineConfig(model=spec, block_size=args.block_size, enable_prefix_caching=False)
        sinks[path] = []
        engines[path] = LLMEngine(loaded_by[path], config, sinks[path].append)
    # What the loads leave lives as long as the run: out of Python's full collections, as the
    # service keeps it for the app and the server (a collection walking it took 185-200 ms, a
    # token's wait, whenever the objects made since the last one passed a quarter of those)
    gc_heap.freeze()
    reference = loaded_by.get("fp32") or next(iter(loaded_by.values()))
    if args.prompt_tokens:
        prompt_ids = synthetic_prompt(reference.info.vocab_size, args.prompt_tokens)
    else:
        messages = [{"role": "user", "content": BENCH_PROMPT}]
        text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = list(reference.tokenizer(text, add_special_tokens=False)["input_ids"])
    llama_runs: list[Any] = []

    def run(path: str) -> Run:
        if path == "generate":
            assert baseline is not None, "generate() runs on transformers' own model, loaded above"
            return run_hf(baseline, prompt_ids, args.new_tokens)
        if path == "llama.cpp":
            assert llama_bench is not None and gguf is not None, "llama.cpp runs only when both were found"
            result = run_llama_bench(
                llama_bench, gguf, len(prompt_ids), args.new_tokens, torch.get_num_threads()
            )
            llama_runs.append(result)
            return len(prompt_ids) / result.prefill_tokens_per_s, [result.itl_s] * (args.new_tokens - 1), None
        return run_engine(engines[path], prompt_ids, args.new_tokens, sinks[path])

    progress("warming up", 0.0)
    for path in wanted:
        if path == "generate":
            assert baseline is not None
            run_hf(baseline, prompt_ids, 4)
        elif path != "llama.cpp":
            run_engine(engines[path], prompt_ids, 4, sinks[path])
    samples: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in wanted}
    outputs: dict[str, list[int]] = {}
    for r in range(args.rounds):
        order = wanted[r % len(wanted) :] + wanted[: r % len(wanted)]  # each path leads a round in turn
        for path in order:
            progress(f"round {r + 1}/{args.rounds}: {path}", (r + 1) / args.rounds)
            ttft, itl, ids = run(path)
            samples[path][0].append(ttft)
            samples[path][1].extend(itl)
            if ids is not None:
                outputs[path] = ids
    results = {p: _summary(*samples[p], per_token=p != "llama.cpp") for p in wanted}
    for p in results:
        results[p]["prefill_tokens_per_s"] = tokens_per_s(len(prompt_ids), statistics.median(samples[p][0]))
    if "llama.cpp" in results:
        notes["llama.cpp"] = (
            "llama-bench reports one mean rate per run: its ITL is the median of those means; it decodes "
            "with the prompt's tokens already in its cache (its -d), as kvscope decodes after the prompt"
        )
        assert llama_bench is not None and gguf is not None
        cached["llama.cpp"] = cached_share(gguf)
        load_s["llama.cpp"] = llama_load_seconds(llama_bench, gguf, torch.get_num_threads())
        peak_rss["llama.cpp"] = max(run.peak_rss_bytes for run in llama_runs)
    if "native" in peak_rss and len(loaded_by) == 1:
        peak_rss["native"] = peak_rss_bytes()  # after the runs too (the KV pool, the kernels' buffers)
    split: dict[str, Any] = {}
    if engines:
        which = "native" if "native" in engines else next(iter(engines))
        progress(f"decode split ({which}, an instrumented run of its own)", 1.0)
        split = {"path": which, **decode_split(engines[which], prompt_ids, args.new_tokens)}
    bandwidth = measure_memory_bandwidth(reference.device)
    mean_context = len(prompt_ids) + args.new_tokens / 2
    mbu: dict[str, dict[str, float]] = {}
    for path, loaded in loaded_by.items():
        if path in results:
            floor = (loaded.info.weight_bytes + mean_context * loaded.info.kv_bytes_per_token) / bandwidth
            mbu[path] = {"floor_itl_s": floor, "mbu": floor / results[path]["median_itl_s"]}
    file_bytes = gguf.stat().st_size if gguf is not None else 0
    if "llama.cpp" in results and "native" in loaded_by:  # the same file's bytes, llama.cpp's ITL
        native_info = loaded_by["native"].info
        floor = (file_bytes + mean_context * native_info.kv_bytes_per_token) / bandwidth
        mbu["llama.cpp"] = {"floor_itl_s": floor, "mbu": floor / results["llama.cpp"]["median_itl_s"]}
    return {
        "model": reference.info.name,
        "device": device_name(reference.device),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "paths": results,
        "ratios": _ratios(results),
        "decode_split_ms": split,
        "bandwidth_bytes_per_s": bandwidth,
        "mbu": mbu,
        "outputs_equal_fp32": {
            p: ids == outputs.get("fp32") for p, ids in outputs.items() if "fp32" in outputs
        },
        "weights_bytes": {p: m.info.weight_bytes for p, m in loaded_by.items()},
        "file_bytes": file_bytes,
        "load_s": load_s,
        "file_cached_before_load": cached,
        "peak_rss_bytes": peak_rss,
        "memory_ratios": {
            f"{p}_peak_rss_vs_file": rss / file_bytes for p, rss in peak_rss.items() if file_bytes
        },
        "kernels": {p: list(m.info.notes) for p, m in loaded_by.items()},
        "notes": notes,
    }


def _ratios(r: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """The issue's figures, each a ratio of two paths measured in this run (None when one is absent);
    decode rates are 1 / median ITL."""

    def ratio(a: str, b: str, key: str, invert: bool = False) -> float | None:
        if a not in r or b not in r:
            return None
        x, y = r[a][key], r[b][key]
        if x is None or y is None:
            return None
        return y / x if invert else x / y

    return {
        "native_itl_vs_llamacpp": ratio("native", "llama.cpp", "median_itl_s"),
        "native_prefill_vs_llamacpp": ratio("native", "llama.cpp", "prefill_tokens_per_s"),
        "native_decode_vs_generate": ratio("native", "generate", "decode_tokens_per_s"),
        "fp32_decode_vs_generate": ratio("fp32", "generate", "decode_tokens_per_s"),
        "int8_decode_vs_fp32": ratio("int8", "fp32", "decode_tokens_per_s"),
        "int8_prefill_vs_fp32": ratio("int8", "fp32", "prefill_tokens_per_s"),
        "int4_decode_vs_fp32": ratio("int4", "fp32", "decode_tokens_per_s"),
        "native_decode_vs_fp32": ratio("native", "fp32", "decode_tokens_per_s"),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _table(r: Report) -> str:
    lines = [
        f"{r['model']} on {r['device']}, {r['threads']} threads, prompt {r['prompt_tokens']} tokens, "
        f"{r['new_tokens']} new, {r['rounds']} rounds interleaved",
        f"{'path':12}{'TTFT ms':>10}{'prefill tok/s':>15}{'median ITL ms':>15}{'p99 ITL ms':>12}{'decode tok/s':>14}",
    ]
    for path, s in r["paths"].items():
        lines.append(
            f"{path:12}{s['ttft_s'] * 1e3:>10.1f}{s['prefill_tokens_per_s']:>15.1f}"
            f"{s['median_itl_s'] * 1e3:>15.2f}{_ms(s['p99_itl_s']):>12}{s['decode_tokens_per_s']:>14.1f}"
        )
    lines.append(
        "ratios (this run): " + ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items() if v is not None)
    )
    split = r["decode_split_ms"]
    if split:
        parts = ("matmuls", "attention", "rest_of_forward", "sampling", "events")
        lines.append(
            f"a decode token of {split['path']} ({split['step_ms']:.2f} ms): "
            + ", ".join(f"{p} {split[p + '_ms']:.2f}" for p in parts)
            + f"; outside matmuls {split['outside_matmuls_ms']:.2f} ms"
        )
    for path in r["paths"]:
        if path in r["load_s"] or path in r["peak_rss_bytes"]:
            load = r["load_s"].get(path)
            rss = r["peak_rss_bytes"].get(path)
            share = r["file_cached_before_load"].get(path)
            warmth = "" if share is None else f" (the file {share:.0%} in the page cache before)"
            lines.append(
                f"{path}: load {'-' if load is None else f'{load:.1f} s'}{warmth}, peak RSS "
                f"{'-' if rss is None else f'{rss / 2**30:.2f} GiB'}"
                + (
                    f" ({rss / r['file_bytes']:.2f}x the file's {r['file_bytes'] / 2**30:.2f} GiB)"
                    if rss and r["file_bytes"]
                    else ""
                )
            )
    for path, m in r["mbu"].items():
        lines.append(f"{path}: bandwidth floor {m['floor_itl_s'] * 1e3:.2f} ms/token, MBU {m['mbu']:.0%}")
    for path, note in r["notes"].items():
        lines.append(f"{path}: {note}")
    return "\n".join(lines)
