"""OpenAI logprobs from the engine's per-token snapshots.

Which distribution: the model's raw next-token distribution, log_softmax of the logits before
any penalty, temperature or truncation. That is what OpenAI's API reports and what vLLM reports
by default (its `logprobs_mode="raw_logprobs"`), so a client computing perplexity, calibration
or confidence from them gets the same quantity from every server; under greedy decoding the
final distribution is one-hot and would say nothing. The chosen token's logprob is under the
same raw distribution. `TokenGenerated.logprob` (the final sampling distribution's) is not used.

The snapshot carries the top 256 raw logits and the log-sum-exp of the whole vocabulary, so any
of the top 20 is `logit - logsumexp` exactly; a drawn token outside them (possible when
sampling) takes its raw probability from the snapshot's "raw" stage.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from engine.events import TokenSnapshot

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default cap
LOG_ZERO = -9999.0  # what vLLM reports for a probability that underflowed to 0


def raw_logprob(snapshot: TokenSnapshot, token_id: int) -> float:
    try:
        i = snapshot.raw_top_ids.index(token_id)
    except ValueError:
        pass
    else:
        return snapshot.raw_top_logits[i] - snapshot.raw_logsumexp
    try:
        p = snapshot.stages[0].probs[snapshot.candidate_ids.index(token_id)]
    except (ValueError, IndexError):
        return LOG_ZERO
    return math.log(p) if p > 0.0 else LOG_ZERO


def top_raw(snapshot: TokenSnapshot, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens under the raw distribution, likeliest first."""
    lse = snapshot.raw_logsumexp
    return [(i, logit - lse) for i, logit in zip(snapshot.raw_top_ids[:k], snapshot.raw_top_logits[:k])]


class TokenStrings:
    """A token's text and its UTF-8 bytes, as OpenAI's `token` and `bytes` fields."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table

    def bytes_of(self, token_id: int) -> list[int]:
        if 0 <= token_id < len(self.table):
            return list(self.table[token_id])
        return []

    def text_of(self, token_id: int, snapshot: TokenSnapshot | None = None) -> str:
        if snapshot is not None and token_id in snapshot.candidate_ids:
            return snapshot.candidate_texts[snapshot.candidate_ids.index(token_id)]
        if 0 <= token_id < len(self.table):
            return self.table[token_id].decode("utf-8", errors="replace")
        return ""

    def chat_entry(self, token_id: int, text: str, snapshot: TokenSnapshot, k: int) -> dict[str, Any]:
        """One `choices[].logprobs.content[]` entry of a chat completion."""
        return {
            "token": text,
            "logprob": raw_logprob(snapshot, token_id),
            "bytes": self.bytes_of(token_id),
            "top_logprobs": [
                {"token": self.text_of(i, snapshot), "logprob": lp, "bytes": self.bytes_of(i)}
                for i, lp in top_raw(snapshot, k)
            ],
        }


def token_bytes_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes]:
    """Every vocabulary entry's bytes (run once at start, on the engine thread).

    Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2) spell bytes as printable characters:
    mapped back through GPT-2's byte table, a token that is half of a UTF-8 character gives its
    one real byte rather than the replacement character a decode would. SentencePiece byte
    fallback pieces (`<0x0A>`) are their byte, `▁` a space; special tokens their text."""
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    byte_level = _is_byte_level(tokenizer)
    decoder = {c: b for b, c in _gpt2_byte_chars().items()}
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    table = []
    for piece in pieces:
        if piece is None:
            table.append(b"")
        elif piece in specials:
            table.append(piece.encode("utf-8"))
        elif byte_level and all(c in decoder for c in piece):
            table.append(bytes(decoder[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        else:
            table.append(piece.replace("▁", " ").encode("utf-8"))
    return table


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the
    others are shifted to code points from 256 up in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return "ByteLevel" in json.dumps(decoder)
