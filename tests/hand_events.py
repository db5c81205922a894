"""Hand-made engine events for the live state's and the views' tests: small, exact, and
consistent with the contracts.

Snapshots are computed from a logits vector with the same stage definitions the engine uses
(softmax, temperature, top-k, top-p), so the numbers a test feeds a panel are ones a real
sampler could have produced.
"""

from __future__ import annotations

import numpy as np

from engine.events import (
    BlockEvent,
    KVStats,
    ModelInfo,
    ModelLoaded,
    RequestFinished,
    RequestStarted,
    RequestStats,
    SequenceFinished,
    SequenceForked,
    StageSnapshot,
    StepStats,
    TokenGenerated,
    TokenSnapshot,
)
from live.page_map import PageMap
from live.state import LiveState


def model_info(**overrides) -> ModelInfo:
    fields = dict(
        name="tiny",
        source="test",
        architecture="LlamaForCausalLM",
        dtype="float32",
        device="cpu",
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        vocab_size=12,
        max_position_embeddings=2048,
        params=1000,
        weight_bytes=4000,
        kv_bytes_per_token=512,
        load_seconds=0.1,
    )
    fields.update(overrides)
    return ModelInfo(**fields)


def model_loaded(num_blocks: int = 16, block_size: int = 16, pool_bytes: int | None = None) -> ModelLoaded:
    if pool_bytes is None:
        pool_bytes = num_blocks * block_size * 512
    return ModelLoaded(model_info(), num_blocks, block_size, pool_bytes, t=0.0)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def snapshot(
    logits, texts, drawn: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> TokenSnapshot:
    """A snapshot over the whole (small) vocabulary `logits`, candidates in raw order."""
    logits = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-logits, kind="stable")
    vocab = len(logits)
    raw = _softmax(logits)
    stages = [StageSnapshot("raw", tuple(raw[order]), (False,) * vocab, vocab, 1.0)]
    alive = np.ones(vocab, bool)
    probs = _softmax(logits / temperature)
    stages.append(StageSnapshot("temperature", tuple(probs[order]), (False,) * vocab, vocab, 1.0))

    def cut(name: str, keep: np.ndarray) -> None:
        nonlocal probs, alive
        removed = alive & ~keep
        kept_mass = float(probs[keep & alive].sum())
        alive = alive & keep
        probs = np.where(alive, probs, 0.0)
        probs = probs / probs.sum()
        stages.append(
            StageSnapshot(name, tuple(probs[order]), tuple(removed[order]), int(alive.sum()), kept_mass)
        )

    if top_k:
        keep = np.zeros(vocab, bool)
        keep[np.argsort(-probs, kind="stable")[:top_k]] = True
        cut("top_k", keep)
    if top_p < 1.0:
        ranked = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[ranked]) - probs[ranked]
        keep = np.zeros(vocab, bool)
        keep[ranked[before < top_p]] = True
        cut("top_p", keep)
    final = probs[probs > 0]
    entropy = float(-(final * np.log(final)).sum())
    raw_entropy = float(-(raw * np.log(raw)).sum())
    lse = float(np.log(np.exp(logits - logits.max()).sum()) + logits.max())
    return TokenSnapshot(
        candidate_ids=tuple(int(i) for i in order),
        candidate_texts=tuple(texts[i] for i in order),
        stages=tuple(stages),
        drawn_id=drawn,
        drawn_prob=float(probs[drawn]),
        entropy=entropy,
        raw_entropy=raw_entropy,
        raw_top_ids=tuple(int(i) for i in order),
        raw_top_logits=tuple(float(logits[i]) for i in order),
        raw_logsumexp=lse,
        penalized_top_logits=tuple(float(logits[i]) for i in order),
    )


def token(
    request_id: int, index: int, t: float, text: str = "x", snap: TokenSnapshot | None = None
) -> TokenGenerated:
    token_id = snap.drawn_id if snap is not None else index
    logprob = float(np.log(snap.drawn_prob)) if snap is not None else -0.5
    return TokenGenerated(request_id, index, token_id, text, text, logprob, snap, t=t)


def finished(
    request_id: int, reason: str, ttft_s: float, itl_s: tuple[float, ...], t: float
) -> RequestFinished:
    n = len(itl_s) + 1
    stats = RequestStats(3, n, 0, ttft_s, itl_s, n / max(ttft_s + sum(itl_s), 1e-9), 0, 1)
    return RequestFinished(request_id, reason, "x" * n, tuple(range(n)), stats, t=t)


def step(kv: KVStats, step_no: int = 1, t: float = 0.0) -> StepStats:
    return StepStats(step_no, 0, 1, 1, 1, 0, 0.02, 0.015, 0.001, kv, t=t)


def beam_step(request_id: int, step: int, parents, texts, scores, seq_ids, finished=(), done=False, t=0.0):
    """One BeamStep; token ids are the slots' positions in `texts` (what a view never needs)."""
    from engine.events import BeamStep, FinishedBeam

    return BeamStep(
        request_id,
        step,
        tuple(parents),
        tuple(range(len(texts))),
        tuple(texts),
        tuple(scores),
        tuple(seq_ids),
        tuple(FinishedBeam(*f) for f in finished),
        done,
        t,
    )


def sample_token(request_id: int, branch: int, index: int, text: str, t: float = 0.0) -> TokenGenerated:
    return TokenGenerated(request_id, index, index, text, text, -0.5, None, t=t, branch=branch)


# ---- a group request ---------------------------------------------------------------------------
BLOCK = 4
FORK_A, FORK_B = 1 << 40, (1 << 40) + 1


def fork_events():
    """Request 1 prefills 6 tokens (a full block 0, block 1 half full) and forks twice; fork A
    then writes its first token: block 1 is shared and partly filled, so A copies it."""
    return [
        RequestStarted(1, 6),
        BlockEvent("allocate", (0, 1), 1),
        BlockEvent("append", (0, 1), 1, 0, 6, (4, 2)),
        SequenceForked(1, 1, FORK_A, 1, 6),
        BlockEvent("share", (0, 1), FORK_A, 0, 6, (4, 2)),
        SequenceForked(1, 1, FORK_B, 2, 6),
        BlockEvent("share", (0, 1), FORK_B, 0, 6, (4, 2)),
        BlockEvent("allocate", (2,), FORK_A),
        BlockEvent("cow", (2,), FORK_A, 4, 6, (2,), src_block_ids=(1,)),
        BlockEvent("free", (1,), FORK_A),
        BlockEvent("append", (2,), FORK_A, 6, 7, (3,)),
        sample_token(1, 1, 0, " blue"),
    ]


def beam_events():
    """Two beams over three steps: at step 1 both extend beam 1 (beam 2 is pruned, a fork
    takes its place); at step 2 a hypothesis ends off beam 2 and the search is done."""
    return [
        RequestStarted(5, 4),
        SequenceForked(5, 5, 9, 1, 4),
        beam_step(5, 0, (0, 0), (" a", " b"), (-0.1, -0.7), (5, 9)),
        SequenceForked(5, 5, 10, 1, 5),
        SequenceFinished(5, 9, 1, "pruned"),
        beam_step(5, 1, (0, 0), ("\n", " c"), (-0.3, -0.9), (5, 10)),
        beam_step(5, 2, (0, 1), (" d", " e"), (-0.5, -1e9), (5, 10), finished=[(1, 2, -0.45)], done=True),
    ]


def loaded_state(num_blocks: int = 8, block_size: int = BLOCK) -> LiveState:
    """A live state that has seen a model load (a pool of `num_blocks` blocks)."""
    state = LiveState()
    state.apply([model_loaded(num_blocks=num_blocks, block_size=block_size)])
    return state


def block_counts(pool: PageMap | KVStats) -> tuple[int, int, int, int]:
    """Used, cached-free and free blocks and written slots: what the page map folded from the
    block events must equal in the engine's own KVStats."""
    return pool.used_blocks, pool.cached_free_blocks, pool.free_blocks, pool.used_slots
