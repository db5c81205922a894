"""The prefix cache's effect on a follow-up turn, said next to the figure it changes.

A follow-up turn re-sends the whole conversation; with prefix caching the engine finds the
earlier turns' blocks and prefills only the new tail, so its TTFT drops. The reply header says how
much of the prompt came from the cache and what the conversation's uncached turn took, both from
the engine's RequestStats (`cached_prompt_tokens`, `ttft_s`), so the two TTFTs sit side by side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class PromptFigures(Protocol):
    """What the note reads of a reply's figures (the engine's RequestStats, or the kept stats of a
    stored reply)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_prompt_tokens(self) -> int: ...

    @property
    def ttft_s(self) -> float: ...


F = TypeVar("F", bound=PromptFigures)


def first_uncached(earlier: Iterable[F | None]) -> F | None:
    """The first earlier reply whose prompt was computed in full (no prefix-cache hit)."""
    return next((s for s in earlier if s is not None and s.cached_prompt_tokens == 0), None)


def prefix_cache_note(stats: PromptFigures, uncached: PromptFigures | None) -> str:
    """e.g. "412 of 430 prompt tokens from the prefix cache; uncached turn 800 ms"; "" when this
    reply found nothing in the cache."""
    if stats.cached_prompt_tokens <= 0:
        return ""
    note = f"{stats.cached_prompt_tokens} of {stats.prompt_tokens} prompt tokens from the prefix cache"
    if uncached is not None and uncached.ttft_s > 0:
        note += f"; uncached turn {uncached.ttft_s * 1000:.0f} ms ({uncached.prompt_tokens} tokens)"
    return note
