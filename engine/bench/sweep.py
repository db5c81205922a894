"""Measured sweeps through the real engine: TTFT against prompt length (prefill scales with the
prompt), ITL against context length (each decode step reads the whole KV), the same per dtype,
and the roofline points of prefill and decode steps at several batch sizes.

Every request is greedy with EOS ignored and prefix caching off, so each run computes exactly
the tokens asked for. Rows are plain dicts (JSON-ready) with the step costs of engine.measure.roofline
beside the timings, so a panel can plot both without recomputing anything.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import ConfigError, EngineConfig, ModelSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import Event, RequestFailed, RequestFinished, StepCost, StepStats
from engine.limits import blocks_for_tokens
from engine.measure.roofline import bound, step_cost
from engine.model.loading import load_model
from engine.request import Request
from engine.results import DeviceLimits
from engine.shapes import ModelShapes
from engine.units import mbu, mfu, tokens_per_s

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.model.loaded import LoadedModel

# Real text, tokenized and repeated to the length a sweep asks for: token identities do not change
# the cost of a step, but a prompt of real text keeps the run what a user would send.
FILLER_TEXT = (
    "The key-value cache stores, for every layer, the keys and values of every token already "
    "seen, so that each new token attends to them without recomputing the whole prefix. "
    "Prefill runs the prompt through the model in one pass; decode then adds one token at a time."
)
BLOCK_SIZE = 16
Progress = Callable[[str], None]
Row = dict[str, Any]  # one JSON-ready row of a sweep
Steps = list[tuple[StepStats, int]]  # a phase's steps with their LM-head rows
T = TypeVar("T")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, length: int) -> list[int]:
    """`length` token ids of FILLER_TEXT, repeated as often as needed."""
    base: list[int] = tokenizer(FILLER_TEXT, add_special_tokens=False)["input_ids"]
    return (base * (length // len(base) + 1))[:length]


def _check_lengths(lengths: list[int], what: str) -> list[int]:
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ConfigError(f"give at least one {what}")
    if any(n < 1 for n in lengths):
        raise ConfigError(f"every {what} must be at least 1 token, got {lengths}")
    return lengths


class _Bench:
    """One loaded model and an engine sized to hold the longest run of a sweep."""

    def __init__(self, loaded: LoadedModel, max_tokens: int, max_seqs: int = 1):
        limit = loaded.info.max_position_embeddings
        if max_tokens > limit:
            raise ConfigError(
                f"the sweep needs {max_tokens} tokens of context but {loaded.info.name} holds {limit}: "
                "choose shorter lengths"
            )
        self.loaded = loaded
        self.shapes = ModelShapes.from_config(loaded.model.config)
        self.dtype_bytes = loaded.dtype.itemsize
        blocks_per_seq = blocks_for_tokens(max_tokens, BLOCK_SIZE)
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=blocks_per_seq * max_seqs,
            max_model_len=limit,
            max_num_seqs=max_seqs,
            # One step takes a whole prompt (or a whole batch of prompts): a prefill is one forward.
            max_num_batched_tokens=max(2048, max_tokens * max_seqs),
            enable_prefix_caching=False,
        )
        self.events: list[Event] = []
        self.engine = LLMEngine(loaded, config, self.events.append)

    def run(self, prompt: list[int], new_tokens: int, copies: int = 1) -> list[RequestFinished]:
        """Submit `copies` identical requests at once and step until all end."""
        self.events.clear()
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        ends = self.engine.run([Request(prompt_token_ids=tuple(prompt), sampling=params)] * copies)
        failed = [e for e in ends if isinstance(e, RequestFailed)]
        if failed:
            raise ConfigError(f"a sweep request failed: {failed[0].message}")
        return [e for e in ends if isinstance(e, RequestFinished)]

    def warm_up(self) -> None:
        """The first forwards pay one-off costs (allocator, kernel selection) no length should carry."""
        self.run(prompt_ids(self.loaded.tokenizer, 16), 3)

    def cost(self, seq_shapes: Iterable[tuple[int, int]], logit_rows: int | None = None) -> StepCost:
        return step_cost(self.shapes, seq_shapes, self.dtype_bytes, self.dtype_bytes, logit_rows)


def _interleaved(
    benches: dict[str, _Bench],
    lengths: list[int],
    repeats: int,
    measure: Callable[[_Bench, int], T],
    progress: Progress,
) -> dict[tuple[str, int], list[T]]:
    """samples[(dtype, length)] = `repeats` measurements, with the dtypes alternating order every
    repeat so that drift (thermal, other processes) falls on all of them alike."""
    samples: dict[tuple[str, int], list[T]] = {}
    names = list(benches)
    for n in lengths:
        for r in range(repeats):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                progress(f"{name}: {n} tokens, run {r + 1}/{repeats}")
                samples.setdefault((name, n), []).append(measure(benches[name], n))
    return samples


def _add_ratios(rows: list[Row], key: str, length_key: str, baseline: str) -> None:
    """Each row's `key` relative to the baseline dtype's at the same length."""
    base = {row[length_key]: row[key] for row in rows if row["dtype"] == baseline}
    for row in rows:
        row[f"{key}_vs_{baseline}"] = row[key] / base[row[length_key]]


def _prompt_rows(
    benches: dict[str, _Bench], lengths: list[int], repeats: int, progress: Progress
) -> list[Row]:
    def measure(bench: _Bench, n: int) -> float:
        (finished,) = bench.run(prompt_ids(bench.loaded.tokenizer, n), 1)
        return finished.stats.ttft_s

    samples = _interleaved(benches, lengths, repeats, measure, progress)
    rows = []
    for (name, n), ttfts in samples.items():
        cost = benches[name].cost([(n, n)])
        ttft = statistics.median(ttfts)
        rows.append(
            {
                "dtype": name,
                "prompt_tokens": n,
                "ttft_s": ttft,
                "ttft_min_s": min(ttfts),
                "prefill_tokens_per_s": tokens_per_s(n, ttft),
                "flops": cost.flops,
                "bytes": cost.bytes_total,
                "intensity": cost.intensity,
                "achieved_flops_per_s": cost.flops / ttft,
            }
        )
    return rows


def _context_rows(
    benches: dict[str, _Bench], contexts: list[int], decode_tokens: int, repeats: int, progress: Progress
) -> list[Row]:
    def measure(bench: _Bench, n: int) -> list[float]:
        # decode_tokens + 1 new tokens: the first comes from the prefill, then decode_tokens gaps.
        (finished,) = bench.run(prompt_ids(bench.loaded.tokenizer, n), decode_tokens + 1)
        return list(finished.stats.itl_s)

    samples = _interleaved(benches, contexts, repeats, measure, progress)
    rows = []
    for (name, n), runs in samples.items():
        bench = benches[name]
        itl = statistics.median(x for run in runs for x in run)
        # Decode step i (from 0) feeds new token i (sampled by the step before) and attends to the
        # prompt plus new tokens 0..i.
        costs = [bench.cost([(1, n + i + 1)]) for i in range(decode_tokens)]
        flops = statistics.fmean(c.flops for c in costs)
        nbytes = statistics.fmean(c.bytes_total for c in costs)
        rows.append(
            {
                "dtype": name,
                "context_tokens": n,
                "median_itl_s": itl,
                "decode_tokens_per_s": tokens_per_s(1, itl),
                "kv_read_bytes": statistics.fmean(c.kv_read_bytes for c in costs),
                "bytes_per_token": nbytes,
                "flops_per_token": flops,
                "achieved_bytes_per_s": nbytes / itl,
            }
        )
    return rows


def _progress(progress: Progress | None) -> Progress:
    return progress or (lambda message: None)


def sweep_prompt_lengths(
    loaded: LoadedModel, lengths: list[int], repeats: int = 3, progress: Progress | None = None
) -> list[Row]:
    """TTFT per prompt length (median of `repeats`), one row per length, in the order given."""
    lengths = _check_lengths(lengths, "prompt length")
    bench = _Bench(loaded, max(lengths) + 1)
    bench.warm_up()
    return _prompt_rows({loaded.info.dtype: bench}, lengths, repeats, _progress(progress))


def sweep_context_lengths(
    loaded: LoadedModel,
    contexts: list[int],
    decode_tokens: int = 8,
    repeats: int = 2,
    progress: Progress | None = None,
) -> list[Row]:
    """Median ITL of `decode_tokens` decode steps after a prompt of each context length."""
    contexts = _check_lengths(contexts, "context length")
    if decode_tokens < 1:
        raise ConfigError(f"decode tokens must be at least 1, got {decode_tokens}")
    bench = _Bench(loaded, max(contexts) + decode_tokens + 1)
    bench.warm_up()
    return _context_rows({loaded.info.dtype: bench}, contexts, decode_tokens, repeats, _progress(progress))


def compare_dtypes(
    source: str,
    dtypes: list[str],
    prompt_lengths: list[int],
    context_lengths: list[int],
    device: str = "auto",
    decode_tokens: int = 8,
    repeats: int = 2,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Both sweeps for `source` loaded in each of `dtypes` (all held at once and measured
    interleaved), each row with its ratio to the first dtype's figure at the same length.

    Raises ModelLoadError for a source or dtype that cannot be loaded (float16 on a CPU)."""

    report = _progress(progress)
    if not dtypes or len(set(dtypes)) != len(dtypes):
        raise ConfigError(f"give one or more different dtypes, got {dtypes}")
    prompt_lengths = _check_lengths(prompt_lengths, "prompt length")
    context_lengths = _check_lengths(context_lengths, "context length")
    benches: dict[str, _Bench] = {}
    for dtype in dtypes:
        report(f"loading {source} in {dtype}")
        # dense weights in each dtype: what the sweep compares (a GGUF's own bits would not change)
        loaded = load_model(ModelSpec(source, dtype=dtype, device=device, quantization="none"))
        longest = max(max(prompt_lengths) + 1, max(context_lengths) + decode_tokens + 1)
        benches[dtype] = _Bench(loaded, longest)
        benches[dtype].warm_up()
    prompt_rows = _prompt_rows(benches, prompt_lengths, repeats, report)
    context_rows = _context_rows(benches, context_lengths, decode_tokens, repeats, report)
    _add_ratios(prompt_rows, "ttft_s", "prompt_tokens", dtypes[0])
    _add_ratios(context_rows, "median_itl_s", "context_tokens", dtypes[0])
    any_loaded = next(iter(benches.values())).loaded
    return {
        "model": any_loaded.info.name,
        "device": str(any_loaded.device),
        "baseline_dtype": dtypes[0],
        "prompt_lengths": prompt_rows,
        "context_lengths": context_rows,
    }


# ---- roofline points ---------------------------------------------------------------------------
def measure_roofline_points(
    loaded: LoadedModel,
    limits: DeviceLimits,
    prompt_tokens: int = 256,
    decode_steps: int = 16,
    batch_sizes: Sequence[int] = (1, 4),
    rounds: int = 2,
    progress: Progress | None = None,
) -> list[Row]:
    """For each batch size: `batch` requests of `prompt_tokens` prefilled together in one step,
    then `decode_steps` decode steps of all of them. Each phase becomes one roofline point:
    counted FLOPs and bytes per step, measured forward time per step, MFU, MBU, and which side
    of the ridge it lies on.

    The scenario runs `rounds` times and each point keeps its fastest round: like the device
    limits it is compared with, a best-of figure says what the hardware can do, while a slower
    round measures whatever else was running on the machine."""
    report = _progress(progress)
    batch_sizes = _check_lengths(list(batch_sizes), "batch size")
    if prompt_tokens < 1 or decode_steps < 1 or rounds < 1:
        raise ConfigError("the prompt, the decode steps and the rounds need to be at least 1 each")
    bench = _Bench(loaded, prompt_tokens + decode_steps + 1, max_seqs=max(batch_sizes))
    bench.warm_up()
    prompt = prompt_ids(loaded.tokenizer, prompt_tokens)
    points = []
    for batch in batch_sizes:
        fastest: dict[str, Steps] = {}
        for r in range(rounds):
            report(
                f"batch {batch}, round {r + 1}/{rounds}: prefill {prompt_tokens} tokens x {batch}, "
                f"then {decode_steps} decode steps"
            )
            bench.run(prompt, decode_steps + 1, copies=batch)
            steps = [(e, e.logit_rows) for e in bench.events if isinstance(e, StepStats)]
            for phase, group in _phases(steps, batch).items():
                if group and (phase not in fastest or _forward_s(group) < _forward_s(fastest[phase])):
                    fastest[phase] = group
        points += [_point(bench, limits, phase, batch, group, rounds) for phase, group in fastest.items()]
    return points


def _phases(steps: Steps, batch: int) -> dict[str, Steps]:
    """The scheduler prefills all prompts in one step and then decodes them together; a step
    that mixes both (none in this scenario) would belong to neither phase."""
    return {
        "prefill": [(s, r) for s, r in steps if s.prefill_tokens and not s.decode_tokens],
        "decode": [
            (s, r) for s, r in steps if s.decode_tokens and not s.prefill_tokens and s.num_seqs == batch
        ],
    }


def _forward_s(group: Steps) -> float:
    return sum(stats.forward_s for stats, _ in group)


def _point(bench: _Bench, limits: DeviceLimits, phase: str, batch: int, group: Steps, rounds: int) -> Row:
    """One roofline point from steps of one phase: totals over the steps, reported per step.
    The time is the model forward's (forward_s), the part the FLOP and byte counts describe."""
    costs = [bench.cost(stats.seq_shapes, rows) for stats, rows in group]
    n = len(group)
    flops = sum(c.flops for c in costs)
    nbytes = sum(c.bytes_total for c in costs)
    seconds = _forward_s(group)
    compute = mfu(flops, seconds, limits.peak_flops)
    memory = mbu(nbytes, seconds, limits.bandwidth)
    intensity = flops / nbytes
    breakdown = {key: sum(c.breakdown[key] for c in costs) / n for key in costs[0].breakdown}
    return {
        "phase": phase,
        "batch": batch,
        "steps": n,
        "best_of_rounds": rounds,
        "query_tokens_per_step": statistics.fmean(sum(q for q, _ in s.seq_shapes) for s, _ in group),
        "mean_context_tokens": statistics.fmean(c for s, _ in group for _, c in s.seq_shapes),
        "flops_per_step": flops / n,
        "bytes_per_step": nbytes / n,
        "intensity": intensity,
        "forward_s_per_step": seconds / n,
        "achieved_flops_per_s": compute.achieved,
        "achieved_bytes_per_s": memory.achieved,
        "mfu": compute.value,
        "mbu": memory.value,
        "mfu_how": compute.how,
        "mbu_how": memory.how,
        "bound": bound(intensity, limits.ridge),
        "breakdown_per_step": breakdown,
    }
