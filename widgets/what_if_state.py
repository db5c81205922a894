"""The probability panel's what-if as a question and its answer (no Qt here): which token under
which settings was asked of the shell, what the shell answered, and what the bars and the banner
show meanwhile. The shell recomputes exactly (engine.core.what_if, through the engine
thread) and says on which logits (the step's own, kept for the token, or recomputed through the
engine's paged forward); ids restart with each engine, so an answer belongs to the token object it
was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SamplingParams
from engine.events import TokenGenerated, TokenSnapshot

WHAT_IF_LABEL = "what-if (settings changed since this token)"
# What a what-if is when the shell does not say on which logits it ran.
WHAT_IF_HOW = "recomputed on the engine: the sampler's own stages under these settings"
WHAT_IF_WAITING = "recomputing this token on the engine…"
WHAT_IF_STREAMING = (
    "select a token, or let the reply finish, to recompute it (each recomputation is a forward "
    "over the whole context); the bars show the token as it was drawn"
)
WhatIfKey = tuple[int, int, SamplingParams]  # request id, token index, the what-if settings


def describe_params(params: SamplingParams) -> str:
    """The warper settings a what-if uses, in the words of the controls."""
    if params.greedy:
        return "greedy (temperature 0)"
    parts = [f"temperature {params.temperature:g}"]
    if params.top_k:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1.0:
        parts.append(f"top-p {params.top_p:g}")
    if params.min_p > 0.0:
        parts.append(f"min-p {params.min_p:g}")
    if params.typical_p < 1.0:
        parts.append(f"typical-p {params.typical_p:g}")
    if params.xtc_probability > 0.0:
        parts.append(f"XTC {params.xtc_threshold:g} at p {params.xtc_probability:g}")
    return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class WhatIfView:
    banner: str
    snapshot: TokenSnapshot | None  # what the bars show; None: the what-if failed
    error: str = ""  # why it failed
    ask: WhatIfKey | None = None  # a question the panel sends the shell now


@dataclass(frozen=True, slots=True)
class _Answer:
    token: TokenGenerated
    params: SamplingParams
    snapshot: TokenSnapshot | None
    error: str
    notes: tuple[str, ...]
    how: str


class WhatIfState:
    def __init__(self) -> None:
        self.params: SamplingParams | None = None  # the what-if's settings (None: off)
        self._asked: tuple[WhatIfKey, TokenGenerated] | None = None
        self._answer: _Answer | None = None

    def answered(
        self,
        key: WhatIfKey,
        snapshot: TokenSnapshot | None,
        error: str,
        notes: tuple[str, ...],
        how: str = WHAT_IF_HOW,
    ) -> bool:
        """Take the shell's answer (`how`: on which logits it ran); False when it answers a
        question no longer asked."""
        asked = self._asked
        if asked is None or asked[0] != key:
            return False
        self._answer = _Answer(asked[1], key[2], snapshot, error, notes, how)
        return True

    def view(self, token: TokenGenerated, recorded: TokenSnapshot, streaming: bool) -> WhatIfView:
        """What to show for `token` (its recorded snapshot `recorded`) under the what-if's
        settings; `streaming`: the panel follows a reply still being generated (no forward per
        token: the recomputation waits for a selected token or the reply's end)."""
        params = self.params
        assert params is not None
        label = f"{WHAT_IF_LABEL}: {describe_params(params)}"
        if streaming:
            return WhatIfView(f"{label}: {WHAT_IF_STREAMING}", recorded)
        answer = self._answer
        if answer is not None and answer.token is token and answer.params == params:
            if answer.snapshot is None:
                return WhatIfView(label, None, answer.error)
            notes = "".join(f"\n· {note}" for note in answer.notes)
            return WhatIfView(f"{label}: {answer.how}{notes}", answer.snapshot)
        key = (token.request_id, token.index, params)
        asked = self._asked
        new = asked is None or asked[0] != key or asked[1] is not token
        if new:
            self._asked = (key, token)
        return WhatIfView(f"{label}: {WHAT_IF_WAITING}", recorded, ask=key if new else None)
