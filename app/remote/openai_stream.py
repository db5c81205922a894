"""A generic OpenAI-compatible server's streamed reply -> the events a local engine emits.

Everything timed here is timed on this client: RequestStarted when the request was sent, each
TokenGenerated when its chunk arrived, so TTFT and inter-token latency are what this app saw
(network included), never the server's own figures. What the server cannot tell is marked:
token ids are -1 (the API gives text, not vocabulary ids), a token's snapshot is its reported
top-K as a single `remote_top_k` stage (live.remote), and block, step and memory events do not
exist. The server's logprob of a token is what it reports (vLLM: the model's raw distribution).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from engine.events import (
    RequestFinished,
    RequestStarted,
    RequestStats,
    SequenceResult,
    StageSnapshot,
    TokenGenerated,
    TokenSnapshot,
    ToolCall,
    ToolCallsParsed,
)
from engine.units import tokens_per_s
from live.remote import REMOTE_TOP_K

UNKNOWN_TOKEN_ID = -1  # the server streams text; which vocabulary id it was is not said


def remote_snapshot(entry: dict) -> TokenSnapshot:
    """A token's reported top-K (`{token, logprob, bytes, top_logprobs}`) as one stage."""
    top = entry.get("top_logprobs") or []
    texts = [token_text(t) for t in top]
    logprobs = [float(t.get("logprob", -math.inf)) for t in top]
    drawn_text, drawn_lp = token_text(entry), float(entry.get("logprob", -math.inf))
    if drawn_text in texts:
        drawn = texts.index(drawn_text)
    else:  # sampled from outside the reported top-K: shown after them, as the engine does
        texts.append(drawn_text)
        logprobs.append(drawn_lp)
        drawn = len(texts) - 1
    probs = tuple(math.exp(lp) for lp in logprobs)
    ids = tuple(-(i + 1) for i in range(len(texts)))  # stand-ins, unique within the token
    stage = StageSnapshot(REMOTE_TOP_K, probs, (False,) * len(probs), len(probs), min(1.0, sum(probs)))
    return TokenSnapshot(ids, tuple(texts), (stage,), ids[drawn], math.exp(drawn_lp), math.nan, math.nan)


def token_text(entry: dict) -> str:
    """The token's text, from its bytes when the server sends them (exact), else its `token`."""
    raw = entry.get("bytes")
    if isinstance(raw, list) and raw:
        try:
            return bytes(raw).decode("utf-8", errors="replace")
        except (TypeError, ValueError):
            pass
    return str(entry.get("token", ""))


@dataclass(slots=True)
class _Branch:
    tokens: int = 0
    times: list[float] = field(default_factory=list)
    text: str = ""
    logprob_sum: float = 0.0
    finish_reason: str | None = None
    # the server's tool_calls deltas, by call index: {"id", "name", "arguments"}
    calls: dict[int, dict] = field(default_factory=dict)


class ReplyAdapter:
    """Follows one streamed chat completion; `feed` each SSE chunk as it arrives."""

    def __init__(self, request_id: int, t_sent: float, n: int = 1, snapshots: bool = True) -> None:
        self.request_id = request_id
        self.t_sent = t_sent
        self.snapshots = snapshots
        self.branches = [_Branch() for _ in range(n)]
        self.usage: dict | None = None

    def started(self) -> RequestStarted:
        # The prompt's length is only known from the final usage chunk.
        return RequestStarted(self.request_id, 0, self.t_sent)

    def feed(self, chunk: dict, t: float) -> list[TokenGenerated]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            if not 0 <= index < len(self.branches):
                continue
            branch = self.branches[index]
            delta = choice.get("delta") or {}
            content = delta.get("content") or choice.get("text") or ""
            entries = (choice.get("logprobs") or {}).get("content") or []
            out.extend(self._tokens(index, branch, content, entries, t))
            for call in delta.get("tool_calls") or []:
                entry = branch.calls.setdefault(
                    int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                )
                entry["id"] = call.get("id") or entry["id"]
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                branch.finish_reason = choice["finish_reason"]
        return out

    def _tokens(
        self, index: int, branch: _Branch, content: str, entries: list, t: float
    ) -> list[TokenGenerated]:
        if not entries:
            if not content:
                return []
            entries = [None]  # a server that sends no logprobs: the chunk is the token
        out, rest = [], content
        for i, entry in enumerate(entries):
            last = i == len(entries) - 1
            text = token_text(entry) if entry is not None else content
            # The chunk's text is its tokens' texts in order (a stop string may shorten the end).
            if last:
                delta = rest
            elif rest.startswith(text):
                delta, rest = text, rest[len(text) :]
            else:
                delta = ""
            logprob = float(entry["logprob"]) if entry is not None and "logprob" in entry else math.nan
            snapshot = remote_snapshot(entry) if entry is not None and self.snapshots else None
            branch.text += delta
            branch.times.append(t)
            if math.isfinite(logprob):
                branch.logprob_sum += logprob
            out.append(
                TokenGenerated(
                    self.request_id,
                    branch.tokens,
                    UNKNOWN_TOKEN_ID,
                    text,
                    delta,
                    logprob,
                    snapshot,
                    t=t,
                    branch=index,
                )
            )
            branch.tokens += 1
        return out

    # ---- the end ---------------------------------------------------------------------------
    def tool_calls(self, t: float) -> list[ToolCallsParsed]:
        """The calls the server read out of each reply (its own parser's), as the engine's event."""
        out = []
        for index, branch in enumerate(self.branches):
            if not branch.calls:
                continue
            calls = tuple(
                ToolCall(c["name"], c["arguments"] or "{}", c["id"]) for _, c in sorted(branch.calls.items())
            )
            raw = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls], ensure_ascii=False)
            out.append(ToolCallsParsed(self.request_id, "server", branch.text, calls, raw, branch=index, t=t))
        return out

    def finished(self, t: float, reason: str | None = None) -> RequestFinished:
        """The stream ended ([DONE]) or was cancelled (`reason="cancelled"`)."""
        first = self.branches[0]
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        generated = sum(b.tokens for b in self.branches)
        times = sorted(x for b in self.branches for x in b.times)
        ttft = times[0] - self.t_sent if times else 0.0
        itl = tuple(b - a for a, b in zip(first.times, first.times[1:]))
        decode = first.times[-1] - first.times[0] if len(first.times) > 1 else 0.0
        stats = RequestStats(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            generated_tokens=int(usage.get("completion_tokens") or generated),
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            ttft_s=ttft,
            itl_s=itl,
            tokens_per_s=tokens_per_s((len(first.times) - 1) * len(self.branches), decode),
            preemptions=0,
            peak_blocks=0,
        )
        reasons = [reason or b.finish_reason or "stop" for b in self.branches]
        sequences = ()
        if len(self.branches) > 1:
            sequences = tuple(
                sorted(
                    (
                        SequenceResult(
                            i, b.text, (UNKNOWN_TOKEN_ID,) * b.tokens, b.logprob_sum, _reason(reasons[i])
                        )
                        for i, b in enumerate(self.branches)
                    ),
                    key=lambda s: -s.score,
                )
            )
        return RequestFinished(
            self.request_id,
            _reason(reasons[0]) if not sequences else _reason(reason or sequences[0].finish_reason),
            first.text if not sequences else sequences[0].text,
            (UNKNOWN_TOKEN_ID,) * first.tokens if not sequences else sequences[0].token_ids,
            stats,
            t,
            sequences,
        )


def _reason(reason: str) -> str:
    """OpenAI's finish reasons in the engine's words ("length", "stop", "cancelled")."""
    return reason if reason in ("length", "cancelled") else "stop"
