"""Logit bias and banned tokens as the user types them: text (or a token id), resolved to the
model's tokens by the engine's tokenizer and shown as tokens, so what is biased is visible.

Entries are separated by `|`. A logit-bias entry is `TEXT=AMOUNT` (the amount -100..100); a
banned entry is just `TEXT`. TEXT is a token id as `#1234`, a "quoted string" (JSON escapes,
keeps leading spaces, which most tokenizers fold into the word: `" Paris"` is another token
than `"Paris"`), or bare text (trimmed). Every token the text tokenizes into gets the bias or
the ban. Parsing is pure; the engine tokenizes (EngineClient.tokens_of, on its thread: `pieces`
is what to ask) and `resolve` pairs its answer with the entries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.api import Tokens
from engine.config import LOGIT_BIAS_LIMIT


class EntryError(ValueError):
    """A typed entry cannot be read; str() says which and why, for the controls' error line."""


@dataclass(frozen=True, slots=True)
class TokenEntry:
    source: str  # as typed
    text: str | None = None  # to tokenize
    token_id: int | None = None  # given as #id
    bias: float | None = None  # logit bias entries only


@dataclass(frozen=True, slots=True)
class ResolvedEntry:
    entry: TokenEntry
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]


def _split(text: str) -> list[str]:
    """Split at `|` outside double quotes."""
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\" and quoted:
            current.append(ch)
            escaped = True
        elif ch == '"':
            current.append(ch)
            quoted = not quoted
        elif ch == "|" and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _target(raw: str, source: str) -> tuple[str | None, int | None]:
    raw = raw.strip()
    if raw.startswith("#") and raw[1:].isdigit():
        return None, int(raw[1:])
    if raw.startswith('"'):
        try:
            text = json.loads(raw)
        except ValueError:
            raise EntryError(f'{source!r}: a quoted text must end with a quote, e.g. " Paris"') from None
        if not isinstance(text, str) or not text:
            raise EntryError(f"{source!r}: the quoted text is empty")
        return text, None
    if not raw:
        raise EntryError(f"{source!r}: no text or #id before the amount")
    return raw, None


def parse_bias(text: str) -> list[TokenEntry]:
    entries = []
    for part in _split(text):
        target, sep, amount = part.rpartition("=")
        if not sep:
            raise EntryError(f"{part!r}: write TEXT=AMOUNT, e.g. Paris=5 or #1234=-100")
        try:
            bias = float(amount)
        except ValueError:
            raise EntryError(f"{part!r}: {amount.strip()!r} is not a number") from None
        if not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
            raise EntryError(f"{part!r}: the amount must be between -100 and 100")
        words, token_id = _target(target, part)
        entries.append(TokenEntry(part, words, token_id, bias))
    return entries


def parse_banned(text: str) -> list[TokenEntry]:
    entries = []
    for part in _split(text):
        words, token_id = _target(part, part)
        entries.append(TokenEntry(part, words, token_id))
    return entries


def pieces(entries: Sequence[TokenEntry]) -> list[str | int]:
    """What the engine is asked to tokenize for `entries`: each one's text, or its token id."""
    return [entry.token_id if entry.token_id is not None else entry.text or "" for entry in entries]


def resolve(entries: Sequence[TokenEntry], tokens: Sequence[Tokens]) -> list[ResolvedEntry]:
    """Each entry with its tokens, as the engine tokenized `pieces(entries)`."""
    out = []
    for entry, found in zip(entries, tokens, strict=True):
        if not found.ids:
            raise EntryError(f"{entry.source!r}: the tokenizer makes no token of it")
        out.append(ResolvedEntry(entry, found.ids, found.texts))
    return out


def bias_pairs(resolved: list[ResolvedEntry]) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias: every token of every entry (a later entry wins for a token)."""
    amounts: dict[int, float] = {}
    for r in resolved:
        for token_id in r.token_ids:
            amounts[token_id] = r.entry.bias or 0.0
    return tuple(amounts.items())


def banned_ids(resolved: list[ResolvedEntry]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(t for r in resolved for t in r.token_ids))


def describe(resolved: list[ResolvedEntry]) -> str:
    """'Paris → ‹Paris› #9042 +5 · " Rome" → ‹·Rome› #12345 -3': what the entries became."""

    def token(text: str, token_id: int) -> str:
        return f"‹{text.replace(' ', '·').replace(chr(10), '⏎')}› #{token_id}"

    parts = []
    for r in resolved:
        tokens = " ".join(token(t, i) for t, i in zip(r.token_texts, r.token_ids))
        amount = f" {r.entry.bias:+g}" if r.entry.bias is not None else ""
        label = r.entry.source.rpartition("=")[0].strip() if r.entry.bias is not None else r.entry.source
        parts.append(f"{label} → {tokens}{amount}")
    return " · ".join(parts)
