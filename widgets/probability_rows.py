"""What the probability panel draws, computed from a token snapshot without any Qt.

A snapshot lists candidate tokens (top-N by raw logit, plus the drawn token when it fell outside
them) and, per sampling stage, each candidate's probability and whether that stage removed it.
The panel shows one stage at a time against the raw distribution; these functions turn a
snapshot and a stage choice into rows, cut lines and summary text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.events import GrammarSnapshot, StageSnapshot, TokenSnapshot
from live.remote import REMOTE_TOP_K, REMOTE_TOP_K_LABEL, REMOTE_TOP_K_MEANING
from widgets.token_text import visible

STAGE_LABELS = {
    "raw": "raw",
    "grammar": "grammar",
    "repetition_penalty": "rep. penalty",
    "presence_penalty": "presence",
    "frequency_penalty": "frequency",
    "temperature": "temperature",
    "top_k": "top-k",
    "top_p": "top-p",
    "min_p": "min-p",
    "dry": "DRY",
    "logit_bias": "logit bias",
    "banned_tokens": "banned",
    "typical_p": "typical-p",
    "xtc": "XTC",
    REMOTE_TOP_K: REMOTE_TOP_K_LABEL,
}


def stage_label(name: str) -> str:
    return STAGE_LABELS.get(name, name.replace("_", " "))


@dataclass(frozen=True, slots=True)
class BarRow:
    token_id: int
    text: str  # the token with whitespace made visible
    prob: float  # under the shown stage (0.0 when removed)
    raw_prob: float  # under the raw softmax: the ghost bar
    removed_by: str | None  # the stage (at or before the shown one) that removed it
    drawn: bool
    stage_probs: tuple[float, ...]  # every stage, for the row's tooltip
    # The full-precision reference's raw probability here, when a quality run measured it.
    reference_prob: float | None = None


def bar_rows(snapshot: TokenSnapshot, stages: tuple[StageSnapshot, ...], stage_index: int) -> list[BarRow]:
    """One row per candidate, in the snapshot's order, as seen after `stages[stage_index]`."""
    shown = stages[stage_index]
    raw = stages[0]
    rows = []
    for i, token_id in enumerate(snapshot.candidate_ids):
        removed_by = next((s.name for s in stages[: stage_index + 1] if s.removed[i]), None)
        rows.append(
            BarRow(
                token_id=token_id,
                text=visible(snapshot.candidate_texts[i]),
                prob=shown.probs[i],
                raw_prob=raw.probs[i],
                removed_by=removed_by,
                drawn=token_id == snapshot.drawn_id,
                stage_probs=tuple(s.probs[i] for s in stages),
            )
        )
    return rows


def cut_lines(rows: list[BarRow]) -> list[tuple[int, str]]:
    """(row index, stage) where a stage's cut begins: every row from there down is removed.

    A trailing drawn token (added because it fell outside the top N) is left out of the test, as
    it sits below the cut by construction. Penalties can reorder candidates, so a stage's
    removals are not always a suffix; then no line is drawn and the rows alone show the cut.
    """
    check = rows[:-1] if rows and rows[-1].drawn and len(rows) > 1 else rows
    lines = []
    for i, row in enumerate(check):
        if row.removed_by is None or (i > 0 and check[i - 1].removed_by == row.removed_by):
            continue
        if all(r.removed_by is not None for r in check[i:]):
            lines.append((i, row.removed_by))
    return lines


def stage_summary(stage: StageSnapshot, vocab: int) -> str:
    """One line on what a stage did to the whole vocabulary."""
    label = stage_label(stage.name)
    if stage.name == REMOTE_TOP_K:
        return f"{REMOTE_TOP_K_MEANING} · {len(stage.probs)} candidates, {stage.kept_mass * 100:.1f}% of the mass"
    if stage.name == "raw":
        return f"raw softmax over {vocab:,} tokens"
    if stage.name == "grammar":
        removed = 1.0 - stage.kept_mass
        return (
            f"grammar: {stage.kept_count:,} of {vocab:,} tokens allowed, "
            f"{share_text(removed)} of the raw mass removed"
        )
    if stage.kept_mass >= 1.0 - 1e-9 and stage.kept_count == vocab:
        return f"{label}: reshapes the distribution, removes nothing"
    return (
        f"{label}: keeps {stage.kept_count:,} of {vocab:,} tokens ({stage.kept_mass * 100:.1f}% of the mass)"
    )


def _mass_digits(share: float) -> int:
    """Decimals that keep a share readable: 41%, 0.3%, 99.98%."""
    if share < 0.01 or share > 0.99:
        return 2
    return 0 if share >= 0.1 else 1


def share_text(share: float) -> str:
    """A share as a percentage that never rounds to all or nothing when it is neither: a mask
    that leaves 0.004% of the raw mass removed "> 99.99%", not "100.00%"."""
    if 0.0 < share < 0.00005:
        return "< 0.01%"
    if 0.99995 <= share < 1.0:
        return "> 99.99%"
    return f"{share * 100:.{_mass_digits(share)}f}%"


def grammar_detail(grammar: GrammarSnapshot) -> str:
    """The grammar stage beyond its counts: what it forced, whether the text could end here,
    and the likeliest tokens it cut (with their raw probabilities)."""
    parts = []
    if grammar.forced:
        parts.append("forced: the only token allowed")
    if grammar.forced_texts:
        parts.append("forces next " + "".join(f"‹{visible(t)}›" for t in grammar.forced_texts))
    if grammar.accepting:
        parts.append("the text is complete here (it may end)")
    if grammar.cut_ids:
        cuts = ", ".join(
            f"‹{visible(t)}› {p * 100:.1f}%" if p >= 0.001 else f"‹{visible(t)}› <0.1%"
            for t, p in zip(grammar.cut_texts, grammar.cut_probs)
        )
        parts.append(f"cut: {cuts}")
    return " · ".join(parts)


def entropy_text(stage: StageSnapshot) -> str:
    """Entropy of a stage from the candidates alone: exact when they hold all of its mass,
    otherwise a lower bound (the missing tail only adds entropy)."""
    probs = [p for p in stage.probs if p > 0.0]
    h = -sum(p * math.log(p) for p in probs)
    exact = abs(sum(probs) - 1.0) < 1e-6
    return f"{h:.2f} nats" if exact else f"≥ {h:.2f} nats"
