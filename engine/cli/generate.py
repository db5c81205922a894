"""`generate` and `chat`: the engine driven synchronously from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

from engine.cli.args import engine_config_from, sampling_from
from engine.core.llm_engine import LLMEngine
from engine.events import Event, GroupStats, RequestFailed, RequestFinished, TokenGenerated
from engine.model.loading import load_model
from engine.request import ChatMessage, Request
from engine.text.chat_template import NOTE_PLAIN_TEXT
from engine.units import milliseconds

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.request import Request

EXIT_REQUEST_FAILED = 1


class Collector:
    """Receives engine events; optionally streams reply text to a terminal as it comes."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.tokens: list[TokenGenerated] = []
        self.outcome: RequestFinished | RequestFailed | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenGenerated):
            self.tokens.append(event)
            if self.stream is not None and event.text_delta:
                self.stream.write(event.text_delta)
                self.stream.flush()
        elif isinstance(event, (RequestFinished, RequestFailed)):
            self.outcome = event


def run_to_end(engine: LLMEngine, request: Request, collector: Collector) -> RequestFinished | RequestFailed:
    """Drive the engine until the request ends; Ctrl-C cancels the request, keeping its text."""
    collector.tokens.clear()
    collector.outcome = None
    (outcome,) = engine.run([request], interruptible=True)
    return outcome


def load_engine(args: argparse.Namespace, collector: Collector) -> LLMEngine:
    config = engine_config_from(args)

    def progress(stage: str, fraction: float) -> None:
        print(f"[{fraction:4.0%}] {stage}", file=sys.stderr)

    loaded = load_model(config.model, progress=progress)
    note = loaded.info.chat_note  # what kvscope does to this model's conversations
    if note and (getattr(args, "system", None) or note == NOTE_PLAIN_TEXT):
        print(f"note: {note}", file=sys.stderr)
    for note in loaded.info.notes:  # how it runs: the weights kept, the forward, the kernels
        print(f"       {note}", file=sys.stderr)
    return LLMEngine(loaded, config, collector)


def result_json(
    outcome: RequestFinished, engine: LLMEngine, tokens: list[TokenGenerated], probs_k: int
) -> dict[str, Any]:
    stats = outcome.stats
    result: dict[str, Any] = {
        "text": outcome.text,
        "token_ids": list(outcome.token_ids),
        "prompt_tokens": stats.prompt_tokens,
        "finish_reason": outcome.finish_reason,
        "note": outcome.note,
        "ttft_s": stats.ttft_s,
        "itl_s": list(stats.itl_s),
        "tokens_per_s": stats.tokens_per_s,
        "kv": {
            "block_size": engine.kv.block_size,
            "num_blocks": engine.kv.pool.num_blocks,
            "peak_blocks_used": engine.peak_blocks_used,
            "blocks_used_end": engine.kv.pool.num_used,
            "bytes_per_block": engine.storage.bytes_per_block,
        },
        "model": {
            "name": engine.loaded.info.name,
            "dtype": engine.loaded.info.dtype,
            "chat_note": engine.loaded.info.chat_note,
            "quantization": engine.loaded.info.quantization,
            "weight_bytes": engine.loaded.info.weight_bytes,
            "notes": list(engine.loaded.info.notes),
        },
    }
    if engine.config.speculative is not None:
        assert engine.proposer is not None, "a speculative engine has its proposer"
        result["speculative"] = {
            "method": engine.config.speculative.method,
            "proposer": engine.proposer.name,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "target_forwards": stats.target_forwards,
            "rounds": stats.spec_rounds,
            "drafted": stats.spec_drafted,
            "accepted": stats.spec_accepted,
            "acceptance_by_position": [
                a / d if d else 0.0
                for a, d in zip(stats.spec_accepted_by_position, stats.spec_drafted_by_position)
            ],
            "token_kinds": [t.spec for t in tokens],
        }
    if probs_k:
        result["probs"] = [token_probs(t, probs_k) for t in tokens]
    if outcome.group is not None:
        result.update(group_json(outcome))
    return result


def _group_of(outcome: RequestFinished) -> GroupStats:
    assert outcome.group is not None, "only an n-sample or beam request has group figures"
    return outcome.group


def group_json(outcome: RequestFinished) -> dict[str, Any]:
    """n samples / beams: every sequence (best first) and the group's block sharing."""
    group = _group_of(outcome)
    return {
        "sequences": [
            {
                "text": s.text,
                "token_ids": list(s.token_ids),
                "score": s.score,
                "finish_reason": s.finish_reason,
                "branch": s.branch,
            }
            for s in outcome.sequences
        ],
        "shared_blocks": group.shared_blocks,
        "unshared_blocks_equivalent": group.unshared_blocks_equivalent,
        "saving": group.saving,
        "cow_copies": group.cow_copies,
    }


def print_group(outcome: RequestFinished) -> None:
    """The sequences one after another with their scores, then the memory figures."""
    group = _group_of(outcome)
    what = "sample" if group.kind == "samples" else "beam"
    for rank, s in enumerate(outcome.sequences):
        label = f"sample {s.branch}" if group.kind == "samples" else f"beam {rank}"
        print(f"--- {label} (score {s.score:.4f}, {len(s.token_ids)} tokens, {s.finish_reason})")
        print(s.text)
    print(
        f"[{group.num_sequences} {what}s: {group.shared_blocks} KV blocks with sharing vs "
        f"{group.unshared_blocks_equivalent} unshared ({group.saving:.1%} saved), "
        f"{group.cow_copies} copy-on-write]",
        file=sys.stderr,
    )


def token_probs(token: TokenGenerated, k: int) -> dict[str, Any]:
    snap = token.snapshot
    assert snap is not None, "--probs asks the engine for a snapshot of every token"
    final = snap.stages[-1]
    out: dict[str, Any] = {
        "id": token.token_id,
        "prob": snap.drawn_prob,
        "top_ids": list(snap.candidate_ids[:k]),
        "top_probs": list(final.probs[:k]),
        "raw_top_probs": list(snap.stages[0].probs[:k]),
        "entropy": snap.entropy,
        # every stage of the pipeline, in order: what it kept of the vocabulary and of the mass
        "stages": [
            {"name": s.name, "kept_count": s.kept_count, "kept_mass": s.kept_mass} for s in snap.stages
        ],
    }
    if snap.grammar is not None:
        g = snap.grammar
        out["grammar"] = {
            "allowed": g.allowed,
            "vocab_size": g.vocab_size,
            "removed_mass": g.removed_mass,
            "forced": g.forced,
            "accepting": g.accepting,
            "forced_ids": list(g.forced_ids),
            "cut_ids": list(g.cut_ids),
            "cut_texts": list(g.cut_texts),
            "cut_probs": list(g.cut_probs),
        }
    return out


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_from(args, snapshot_top_n=args.probs)  # bad settings fail before the load
    grouped = params.group_size > 1  # several sequences: printed at the end, not interleaved
    collector = Collector(stream=None if args.json or grouped else sys.stdout)
    engine = load_engine(args, collector)
    request = Request.chat(args.prompt, system=args.system, sampling=params)
    outcome = run_to_end(engine, request, collector)
    if isinstance(outcome, RequestFailed):
        print(f"error: {outcome.message}", file=sys.stderr)
        return EXIT_REQUEST_FAILED
    if args.json:
        print(json.dumps(result_json(outcome, engine, collector.tokens, args.probs)))
    elif outcome.group is not None:
        print_group(outcome)
    else:
        s = outcome.stats
        reason = f"{outcome.finish_reason}: {outcome.note}" if outcome.note else outcome.finish_reason
        print(
            f"\n[{s.generated_tokens} tokens, {reason}; TTFT {milliseconds(s.ttft_s)}, "
            f"{s.tokens_per_s:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    collector = Collector(stream=sys.stdout)
    engine = load_engine(args, collector)
    params = sampling_from(args)
    history: list[ChatMessage] = [ChatMessage("system", args.system)] if args.system else []
    print("kvscope chat: empty line or Ctrl-D to quit, Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            user = input("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user:
            return 0
        history.append(ChatMessage("user", user))
        outcome = run_to_end(engine, Request(messages=tuple(history), sampling=params), collector)
        if isinstance(outcome, RequestFailed):
            print(f"\nerror: {outcome.message}", file=sys.stderr)
            history.pop()  # the message stays on screen; the user can rephrase
            continue
        history.append(ChatMessage("assistant", outcome.text))
        s = outcome.stats
        reason = f"{outcome.finish_reason}: {outcome.note}" if outcome.note else outcome.finish_reason
        print(
            f"\n[{s.generated_tokens} tok, {s.tokens_per_s:.1f} tok/s, {reason}]",
            file=sys.stderr,
        )
