"""Sentences that explain a measured sweep (`engine.bench.sweep.compare_dtypes`' report), drawn only from
its numbers (no Qt here).

How a phase's time changes with the dtype tells which roof it is under. A narrower dtype moves
fewer bytes per step; a phase whose speed follows those bytes is memory-bound. A phase that does
not gain from them (or gains far more than they explain) runs at the speed of the arithmetic:
compute-bound. On a CPU without native bf16 math, bfloat16 prefill gets slower while bfloat16
decode gets faster, which is the whole story of the roofline in two numbers.
"""

from __future__ import annotations

import math

from engine.units import milliseconds

# Within this factor a ratio reads as "about the same": timing noise on a busy machine.
SAME = 1.1
# A phase faster than its byte saving by more than this factor gains from faster arithmetic.
BEYOND_BYTES = 1.25


def change(time_ratio: float) -> str:
    """'2.9x slower' / '1.7x faster' / 'about as fast' for a time ratio (new / baseline)."""
    if time_ratio >= SAME:
        return f"{time_ratio:.1f}x slower"
    if time_ratio <= 1 / SAME:
        return f"{1 / time_ratio:.1f}x faster"
    return "about as fast"


def bound_from_dtype_change(time_ratio: float, byte_ratio: float) -> str | None:
    """How a phase's time moved against its bytes (both new / baseline):
    'memory-bound'   its speed followed the change in bytes (more than halfway, in log space);
    'overhead-bound' its time stayed put although the bytes changed: fixed per-step costs
                     (kernel launches, Python, synchronisation) set it, not bytes or FLOPs;
    'compute-bound'  it moved the other way, or far beyond the bytes: the dtype's arithmetic.
    None when the bytes barely changed (nothing to tell the causes apart)."""
    byte_gain = 1 / byte_ratio
    if 1 / SAME < byte_gain < SAME:
        return None
    speed = 1 / time_ratio
    if byte_gain > 1:
        follows = math.sqrt(byte_gain) <= speed <= byte_gain * BEYOND_BYTES
    else:
        follows = byte_gain / BEYOND_BYTES <= speed <= math.sqrt(byte_gain)
    if follows:
        return "memory-bound"
    return "overhead-bound" if 1 / SAME < speed < SAME else "compute-bound"


def _rows(report: dict, key: str, dtype: str) -> list[dict]:
    return [row for row in report[key] if row["dtype"] == dtype]


def _ratios_at(rows, base_rows, length: str, pick, keys: tuple[str, ...]) -> tuple[int, list[float]]:
    """(the length chosen by `pick` among those both dtypes measured, value(dtype) / value(baseline)
    there for each of `keys`)."""
    base = {row[length]: row for row in base_rows}
    mine = {row[length]: row for row in rows if row[length] in base}
    at = pick(mine)
    return at, [mine[at][key] / base[at][key] for key in keys]


def _device_words(device: str) -> str:
    return "this GPU" if device.startswith("cuda") else "this CPU"


def dtype_sentence(report: dict, dtype: str) -> str:
    """e.g. 'bfloat16 prefill 2.9x slower (512-token prompt), decode 1.7x faster (128 tokens of
    context) than float32, with 2.0x fewer bytes per step: prefill is compute-bound, decode
    memory-bound on this CPU.'

    Prefill is compared at the longest prompt, where its arithmetic dominates fixed per-step
    costs; decode at the shortest context, where reading the weights dominates and the attention
    kernels' behaviour at long contexts does not enter."""
    base = report["baseline_dtype"]
    prompt_at, (prefill_time, prefill_bytes) = _ratios_at(
        _rows(report, "prompt_lengths", dtype), _rows(report, "prompt_lengths", base),
        "prompt_tokens", max, ("ttft_s", "bytes"),
    )  # fmt: skip
    context_at, (decode_time, decode_bytes) = _ratios_at(
        _rows(report, "context_lengths", dtype), _rows(report, "context_lengths", base),
        "context_tokens", min, ("median_itl_s", "bytes_per_token"),
    )  # fmt: skip
    head = (
        f"{dtype} against {base}: prefill {change(prefill_time)} ({prompt_at}-token prompt), decode "
        f"{change(decode_time)} ({context_at} tokens of context)"
    )
    if 1 / SAME < decode_bytes < SAME:
        return f"{head}, moving about the same bytes: the difference is the speed of their arithmetic."
    head += f", with {1 / decode_bytes:.1f}x {'fewer' if decode_bytes < 1 else 'more'} bytes per step"
    verdicts = {
        "prefill": bound_from_dtype_change(prefill_time, prefill_bytes),
        "decode": bound_from_dtype_change(decode_time, decode_bytes),
    }
    where = _device_words(report["device"])
    if verdicts["prefill"] == verdicts["decode"]:
        sentence = f"{head}: both phases are {verdicts['prefill']} on {where}."
    else:
        sentence = f"{head}: prefill is {verdicts['prefill']}, decode {verdicts['decode']} on {where}."
    if "overhead-bound" in verdicts.values():
        sentence += (
            " (Overhead-bound: its time did not move with the bytes, so fixed per-step costs such as "
            "kernel launches and Python set it, not memory or arithmetic.)"
        )
    return sentence


def scaling_sentence(report: dict, dtype: str) -> str:
    """How TTFT grew with the prompt and ITL with the context, for one dtype."""
    parts = []
    prompt = sorted(_rows(report, "prompt_lengths", dtype), key=lambda r: r["prompt_tokens"])
    if len(prompt) >= 2:
        first, last = prompt[0], prompt[-1]
        growth = last["ttft_s"] / first["ttft_s"]
        tokens = last["prompt_tokens"] / first["prompt_tokens"]
        # Judged in log space, as the dtype verdicts: more than halfway to the token ratio.
        why = (
            "prefill computes every prompt token"
            if growth >= math.sqrt(tokens)
            else "far less: fixed per-step costs still dominate prefill at these lengths"
        )
        parts.append(
            f"TTFT {milliseconds(first['ttft_s'])} → {milliseconds(last['ttft_s'])} ({growth:.1f}x) from {first['prompt_tokens']} "
            f"to {last['prompt_tokens']} prompt tokens ({tokens:.0f}x the tokens; {why})"
        )
    decode = sorted(_rows(report, "context_lengths", dtype), key=lambda r: r["context_tokens"])
    if len(decode) >= 2:
        first, last = decode[0], decode[-1]
        growth = last["median_itl_s"] / first["median_itl_s"]
        more_bytes = last["bytes_per_token"] / first["bytes_per_token"]
        kv_share = last["kv_read_bytes"] / last["bytes_per_token"]
        why = (
            f"each decode step reads the whole KV cache: {more_bytes:.2f}x the bytes, {kv_share:.0%} of "
            f"them KV at {last['context_tokens']}"
            if growth <= more_bytes * BEYOND_BYTES
            else f"more than its {more_bytes:.2f}x bytes explain: attention over the long context costs "
            "beyond its reads here"
        )
        parts.append(
            f"ITL {milliseconds(first['median_itl_s'])} → {milliseconds(last['median_itl_s'])} ({growth:.2f}x) from "
            f"{first['context_tokens']} to {last['context_tokens']} tokens of context ({why})"
        )
    if not parts:
        return ""
    return f"In {dtype}: " + "; ".join(parts) + "."


def explain_parts(report: dict) -> tuple[list[str], list[str]]:
    """(the dtype comparisons: the striking part, the scaling of each dtype with length)."""
    base = report["baseline_dtype"]
    dtypes = list(dict.fromkeys(row["dtype"] for row in report["prompt_lengths"]))
    comparisons = [dtype_sentence(report, d) for d in dtypes if d != base]
    scaling = [s for s in (scaling_sentence(report, d) for d in dtypes) if s]
    return comparisons, scaling


def explain(report: dict) -> str:
    """The sweep in a few sentences: per-dtype comparison first, then scaling."""
    comparisons, scaling = explain_parts(report)
    return " ".join(comparisons + scaling)
