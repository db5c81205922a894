"""`python -m engine bench --grammar`: what constrained decoding costs, measured in one run.

The stage: the model decodes the same prompt greedily with and without a JSON Schema, the two
interleaved round by round; the grammar's own work on the engine thread (its mask computed and
applied, the token consumed) is timed where it runs, per token, and set against the ITL of the
constrained run (the issue's goal: under 5%). The first grammar of a model also builds the
library's view of its vocabulary, once: reported apart.

The libraries (`--grammar-libraries`): llguidance, which kvscope uses, against xgrammar when it
is installed (`pip install xgrammar`; kvscope does not need it), over the same model's
vocabulary: compile time, and mask time per token along fixed valid documents, and the positions
where their masks differ (what each lets through). engine/grammar/compile.py says what these
numbers decided.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

import engine.sampling.sampler as sampler_module
from engine.config import EngineConfig, GrammarSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.grammar.compile import JSON_OPTIONS
from engine.grammar.state import GrammarState
from engine.request import Request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.model.loaded import LoadedModel

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "role": {"enum": ["engineer", "artist", "teacher", "doctor"]},
    },
    "required": ["name", "age", "hobbies", "role"],
    "additionalProperties": False,
}
# Many people, so a constrained reply runs as long as a plain one.
PEOPLE = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 20}},
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = "List twenty fictional people as JSON: name, age, email, hobbies and role for each."

# The libraries' walk: schemas and a document each that the schema accepts.
DOCUMENTS: list[tuple[str, dict[str, Any], Any]] = [
    (
        "person",
        PERSON,
        {
            "name": "Ada Lovelace",
            "age": 36,
            "email": "ada@math.org",
            "hobbies": ["poetry", "engines"],
            "role": "engineer",
        },
    ),
    (
        "nested+$ref",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "path": {"type": "array", "items": {"$ref": "#/$defs/point"}},
                "closed": {"type": "boolean"},
            },
            "required": ["path", "closed"],
            "additionalProperties": False,
        },
        {"path": [{"x": 1.5, "y": -2}, {"x": 3, "y": 4.25}, {"x": 0, "y": 0}], "closed": True},
    ),
    (
        "enum-heavy",
        {
            "type": "object",
            "properties": {
                "colours": {
                    "type": "array",
                    "items": {
                        "enum": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]
                    },
                }
            },
            "required": ["colours"],
            "additionalProperties": False,
        },
        {"colours": ["red", "cyan", "black", "white", "green"]},
    ),
]


@contextlib.contextmanager
def timed(owner: Any, name: str, spent: list[float]) -> Iterator[None]:
    """`owner.name` wrapped to add its wall time to `spent` while the block runs."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _run(engine: LLMEngine, params: SamplingParams) -> RequestFinished:
    (done,) = engine.run([Request.chat(PROMPT, sampling=params)])
    if not isinstance(done, RequestFinished):
        raise RuntimeError(f"the benchmark's request failed: {done.message}")
    return done


def bench_stage(loaded: LoadedModel, new_tokens: int, rounds: int, block_size: int) -> dict[str, Any]:
    """ITL with and without the grammar, interleaved, and the grammar's own time per token."""

    engine = LLMEngine(loaded, EngineConfig(block_size=block_size))
    grammar = GrammarSpec("json_schema", json.dumps(PEOPLE))
    plain = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, grammar=grammar)
    start = time.perf_counter()
    engine.grammars.compiled(grammar)  # the vocabulary, built once per model
    vocabulary_s = time.perf_counter() - start
    _run(engine, plain)  # warm-up of both paths
    _run(engine, constrained)
    itl: dict[str, list[float]] = {"plain": [], "grammar": []}
    spent: list[float] = []
    tokens = 0
    texts = []
    for _ in range(rounds):
        itl["plain"] += _run(engine, plain).stats.itl_s
        with (
            timed(GrammarState, "mask", spent),
            timed(GrammarState, "consume", spent),
            timed(sampler_module, "apply_mask", spent),
        ):
            done = _run(engine, constrained)
        itl["grammar"] += done.stats.itl_s
        tokens += done.stats.generated_tokens
        texts.append(done.text)
    per_token = sum(spent) / max(1, tokens)
    median = {k: statistics.median(v) for k, v in itl.items()}
    return {
        "model": loaded.info.name,
        "weights": loaded.info.quantization,
        "vocab_size": loaded.info.vocab_size,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "vocabulary_build_s": vocabulary_s,
        "itl_median_s": median,
        "itl_ratio_grammar_over_plain": median["grammar"] / median["plain"],
        "grammar_s_per_token": per_token,
        "grammar_share_of_itl": per_token / median["grammar"],
        "goal_share_of_itl": 0.05,
        "sample_text": texts[-1][:200],
    }


def _document_ids(tokenizer: PreTrainedTokenizerBase, doc: Any) -> list[int]:
    text = json.dumps(doc)  # ", " and ": ", the layout kvscope's JSON grammar asks for
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + [int(tokenizer.eos_token_id)]


def _bits(words: Any, vocab: int) -> Any:

    return np.unpackbits(words[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
        "max_us": ordered[-1] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


def bench_libraries(tokenizer: PreTrainedTokenizerBase, vocab: int, repeats: int = 3) -> dict[str, Any]:
    """llguidance and (when installed) xgrammar over the same vocabulary and documents."""
    # imported here: llguidance.torch compiles a function at import, which pulls torch's compiler
    # stack (+44 MiB resident, 0.9 s) into every process that imports the bench modules, and
    # `engine bench --model FILE` reports its process's peak RSS as the engine's
    import llguidance.torch as llg_torch

    report: dict[str, Any] = {"vocab_size": vocab, "libraries": {}, "differences": {}, "positions": {}}
    start = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)  # type: ignore[arg-type]
    ll: dict[str, Any] = {"version": llguidance.__version__, "vocabulary_s": time.perf_counter() - start}
    xgr: Any
    try:
        import xgrammar  # optional: only this comparison uses it, kvscope does not depend on it

        xgr = xgrammar
    except ImportError:
        xgr = None
        report["libraries"]["xgrammar"] = {"missing": "pip install xgrammar to compare"}
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    xg: dict[str, Any] = {}
    if xgr is not None:
        start = time.perf_counter()
        xg_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        xg = {"version": version("xgrammar"), "vocabulary_s": time.perf_counter() - start}
        compiler = xgr.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)
    ll_masks: list[float] = []
    xg_masks: list[float] = []
    ll_compile: dict[str, float] = {}
    xg_compile: dict[str, float] = {}
    for name, schema, doc in DOCUMENTS:
        ids = _document_ids(tokenizer, doc)
        differ: list[dict[str, Any]] = []
        for repeat in range(repeats):
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            ll_compile[name] = min(ll_compile.get(name, 1e9), time.perf_counter() - t0)
            xm = None
            if xgr is not None:
                t0 = time.perf_counter()
                compiled = compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
                )
                xm = xgr.GrammarMatcher(compiled)
                xg_compile[name] = min(xg_compile.get(name, 1e9), time.perf_counter() - t0)
            ll_words = llg_torch.allocate_token_bitmask(1, vocab)
            xg_words = xgr.allocate_token_bitmask(1, vocab) if xgr is not None else None
            for position, token in enumerate(ids):
                t0 = time.perf_counter()
                llg_torch.fill_next_token_bitmask(matcher, ll_words)
                ll_masks.append(time.perf_counter() - t0)
                if xm is not None:
                    t0 = time.perf_counter()
                    xm.fill_next_token_bitmask(xg_words)
                    xg_masks.append(time.perf_counter() - t0)
                    if repeat == 0:  # the masks are the same every time: compared once
                        a, b = _bits(ll_words, vocab), _bits(xg_words, vocab)
                        if (a != b).any():
                            only_xg = (b & ~a).nonzero()[0]
                            differ.append(
                                {
                                    "position": position,
                                    "only_llguidance": [
                                        tokenizer.decode([i]) for i in (a & ~b).nonzero()[0][:4]
                                    ],
                                    "only_xgrammar": [tokenizer.decode([i]) for i in only_xg[:4]],
                                    # special tokens (EOS, chat markers) one lets into the text
                                    "special_only_xgrammar": [
                                        tokenizer.decode([i]) for i in only_xg if int(i) in special
                                    ][:6],
                                    "count": int((a != b).sum()),
                                }
                            )
                    assert xm.accept_token(token), f"xgrammar refused token {position} of {name}"
                assert matcher.consume_token(token), f"llguidance refused token {position} of {name}"
        report["positions"][name] = len(ids)
        if differ:
            report["differences"][name] = differ
    ll.update({"compile_ms": {k: v * 1e3 for k, v in ll_compile.items()}, "mask": _stats(ll_masks)})
    report["libraries"]["llguidance"] = ll
    if xgr is not None:
        xg.update({"compile_ms": {k: v * 1e3 for k, v in xg_compile.items()}, "mask": _stats(xg_masks)})
        report["libraries"]["xgrammar"] = xg
    return report


def run_grammar_bench(args: argparse.Namespace, loaded: LoadedModel) -> int:
    report: dict[str, Any] = {}
    if args.grammar_libraries:
        print("libraries: llguidance vs xgrammar over the model's vocabulary", file=sys.stderr)
        report["libraries"] = bench_libraries(loaded.tokenizer, loaded.info.vocab_size)
    print("stage: greedy decoding with and without a JSON Schema, interleaved", file=sys.stderr)
    report["stage"] = bench_stage(loaded, args.new_tokens, args.rounds, args.block_size)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print(report, print)
    return 0


def _print(report: dict[str, Any], out: Callable[[str], None]) -> None:
    libs = report.get("libraries")
    if libs is not None:
        out(f"libraries over a {libs['vocab_size']:,}-token vocabulary:")
        for name, lib in libs["libraries"].items():
            if "missing" in lib:
                out(f"  {name}: {lib['missing']}")
                continue
            compile_ms = ", ".join(f"{k} {v:.1f} ms" for k, v in lib["compile_ms"].items())
            m = lib["mask"]
            out(
                f"  {name} {lib['version']}: vocabulary {lib['vocabulary_s']:.2f} s; compile {compile_ms}; "
                f"mask per token median {m['median_us']:.0f} us, p99 {m['p99_us']:.0f} us, max {m['max_us']:.0f} us"
            )
        for name, rows in libs["differences"].items():
            specials = [r for r in rows if r["special_only_xgrammar"]]
            out(
                f"  {name}: masks differ at {len(rows)} of {libs['positions'][name]} positions; at {len(specials)} xgrammar lets special "
                f"tokens into the text, e.g. {specials[0]['special_only_xgrammar'] if specials else []}"
            )
            for row in [r for r in rows if not r["special_only_xgrammar"]][:2]:
                out(
                    f"    token {row['position']}: only llguidance {row['only_llguidance']}, "
                    f"only xgrammar {row['only_xgrammar']}"
                )
    s = report["stage"]
    out(
        f"stage on {s['model']} ({s['weights']}, {s['vocab_size']:,} tokens), {s['rounds']} x {s['new_tokens']} tokens:"
    )
    out(f"  vocabulary built once: {s['vocabulary_build_s']:.2f} s")
    out(
        f"  ITL median: plain {s['itl_median_s']['plain'] * 1e3:.2f} ms, with the grammar "
        f"{s['itl_median_s']['grammar'] * 1e3:.2f} ms (ratio {s['itl_ratio_grammar_over_plain']:.3f})"
    )
    out(
        f"  the grammar's own work: {s['grammar_s_per_token'] * 1e6:.0f} us per token = "
        f"{s['grammar_share_of_itl']:.1%} of ITL (goal < {s['goal_share_of_itl']:.0%})"
    )
