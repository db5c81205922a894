"""`python -m engine bench`: the engine against transformers' generate() on the same model,
prompt and dtype, interleaved round by round in one process, reported as ratios; plus the
decode bandwidth floor (bytes read per token / measured memory bandwidth) and the engine's MBU.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from engine.events import TokenGenerated
from engine.units import milliseconds, si

BENCH_PROMPT = (
    "Explain, in a few paragraphs, why the key-value cache makes autoregressive decoding of a "
    "transformer faster, and what it costs in memory as the context grows."
)


class _TokenClock(StoppingCriteria):
    """Records when generate() produced each token (it calls stopping criteria once per step)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(model, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[float], list[int]]:
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
    return clock.times[0] - start, _gaps(clock.times), out[0, len(prompt_ids) :].tolist()


def run_engine(engine, prompt_ids: list[int], new_tokens: int, events: list):
    from engine.config import SamplingParams
    from engine.request import Request

    events.clear()
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=tuple(prompt_ids), sampling=params))
    while engine.has_work():
        engine.step()
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    times = [e.t for e in tokens]
    return times[0] - start, _gaps(times), [e.token_id for e in tokens]


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _summary(ttfts: list[float], itls: list[float]) -> dict:
    itls_sorted = sorted(itls)
    p99 = itls_sorted[min(len(itls_sorted) - 1, int(0.99 * len(itls_sorted)))]
    return {
        "ttft_s": statistics.median(ttfts),
        "median_itl_s": statistics.median(itls),
        "p99_itl_s": p99,
        "tokens_per_s": len(itls) / sum(itls),
    }


def run_bench(args) -> int:
    from engine.config import EngineConfig, ModelSpec
    from engine.core.llm_engine import LLMEngine
    from engine.measure.memory import device_name, measure_memory_bandwidth
    from engine.model.loading import load_model

    spec = ModelSpec(args.model, dtype=args.dtype, device=args.device)
    loaded = load_model(spec, progress=lambda stage, f: print(f"[{f:4.0%}] {stage}", file=sys.stderr))
    if args.speculation:
        from engine.measure.bench_speculative import run_speculative_bench

        return run_speculative_bench(args, loaded)
    if args.concurrency:
        from engine.measure.bench_concurrency import run_concurrency_bench

        return run_concurrency_bench(args, loaded)
    events: list = []
    # Prefix caching off: every round prefills the whole prompt, as generate() does.
    engine = LLMEngine(
        loaded,
        EngineConfig(model=spec, block_size=args.block_size, enable_prefix_caching=False),
        events.append,
    )
    messages = [{"role": "user", "content": BENCH_PROMPT}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])

    print("warming up", file=sys.stderr)
    run_hf(loaded.model, prompt_ids, 4)
    run_engine(engine, prompt_ids, 4, events)

    results = {"hf": ([], []), "engine": ([], [])}
    outputs = {}
    for r in range(args.rounds):
        order = ("hf", "engine") if r % 2 == 0 else ("engine", "hf")  # cancel drift
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr)
            if name == "hf":
                ttft, itl, ids = run_hf(loaded.model, prompt_ids, args.new_tokens)
            else:
                ttft, itl, ids = run_engine(engine, prompt_ids, args.new_tokens, events)
            results[name][0].append(ttft)
            results[name][1].extend(itl)
            outputs[name] = ids

    hf, eng = _summary(*results["hf"]), _summary(*results["engine"])
    print("measuring memory bandwidth", file=sys.stderr)
    bandwidth = measure_memory_bandwidth(loaded.device)
    info = loaded.info
    mean_context = len(prompt_ids) + args.new_tokens / 2
    bytes_per_token = info.weight_bytes + mean_context * info.kv_bytes_per_token
    floor_s = bytes_per_token / bandwidth
    report = {
        "model": info.name,
        "dtype": info.dtype,
        "device": device_name(loaded.device),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "transformers_generate": hf,
        "engine": eng,
        "ratio": {
            "decode_tokens_per_s": eng["tokens_per_s"] / hf["tokens_per_s"],
            "ttft": hf["ttft_s"] / eng["ttft_s"],
        },
        "outputs_match": outputs["hf"] == outputs["engine"],
        "bandwidth": {
            "measured_bytes_per_s": bandwidth,
            "bytes_read_per_decode_token": bytes_per_token,
            "floor_itl_s": floor_s,
            "engine_mbu": floor_s / eng["median_itl_s"],
            "generate_mbu": floor_s / hf["median_itl_s"],
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _print_table(r: dict) -> None:
    hf, eng = r["transformers_generate"], r["engine"]
    print(
        f"{r['model']} {r['dtype']} on {r['device']}, torch threads {r['threads']}, prompt {r['prompt_tokens']} tok"
    )
    print(f"{'':24}{'generate()':>14}{'engine':>14}")
    for key, label, scale in [
        ("ttft_s", "TTFT ms", 1000),
        ("median_itl_s", "median ITL ms", 1000),
        ("p99_itl_s", "p99 ITL ms", 1000),
        ("tokens_per_s", "decode tok/s", 1),
    ]:
        print(f"{label:24}{hf[key] * scale:>14.2f}{eng[key] * scale:>14.2f}")
    print(f"decode speed ratio engine/generate: {r['ratio']['decode_tokens_per_s']:.3f}")
    bw = r["bandwidth"]
    print(
        f"bandwidth {si(bw['measured_bytes_per_s'], 'B/s')}; floor ITL {milliseconds(bw['floor_itl_s'])}; "
        f"engine MBU {bw['engine_mbu']:.1%}; outputs match: {r['outputs_match']}"
    )
