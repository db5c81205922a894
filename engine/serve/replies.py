"""Engine events of one HTTP request -> OpenAI chunks (streaming) or one response body.

A `Reply` follows the engine requests of one HTTP request (one per completions prompt) and turns
each batch of their events into chunks: one per choice that changed, carrying every token the
batch brought for it (a client reads the same text and logprobs as with a chunk per token, at a
fraction of the serialisation). Choice `i * n + branch` is sample `branch` of prompt `i`.

Given a tokenizer, the reply makes its text itself from the token ids (the engine was asked for
none: Request.detokenize), with the engine's own streaming detokenizer, on the server's thread.
It finds the stop strings in that text too: a choice ends at the token that completes one, the
tokens the engine made after it (its steps run ahead of the server) are dropped from the reply
and its usage, and once every choice of an engine request has stopped the reply cancels that
request (`cancel`), as vLLM's front end aborts a request its detokenizer stopped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from engine.events import (
    RequestFailed,
    RequestFinished,
    RequestStarted,
    RequestStats,
    SequenceFinished,
    TokenGenerated,
    ToolCallsParsed,
)
from engine.serve.bridge import Started
from engine.serve.errors import ServeError
from engine.serve.logprobs import TokenStrings, raw_logprob, top_raw
from engine.serve.params import Plan, param_of
from engine.serve.tool_stream import Deltas, ToolStream
from engine.text.detokenize import IncrementalDetokenizer
from engine.tools.formats import ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Json = dict[str, Any]  # a chunk, a body or a part of one, as it is serialised
# A token's logprobs entry: chat, `choices[].logprobs.content[]`'s object; completions, (token,
# logprob, top logprobs by token, text offset): logprob and top are None for a prompt's first token
CompletionEntry = tuple[str, float | None, dict[str, float] | None, int]
LogprobEntry = Json | CompletionEntry


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """A completion prompt as `echo` returns it before the reply: its text, and with `logprobs`
    each of its tokens scored under the ones before it (engine/core/scoring.py)."""

    text: str
    entries: tuple[CompletionEntry, ...]
    tokens: int


@dataclass(slots=True)
class Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    text_offset: int = 0  # completions: characters before the next token
    # A request with tools: the reply split into content and calls as it streams.
    tools: ToolStream | None = None
    parsed: ToolCallsParsed | None = None  # the engine's reading of the whole reply
    ended: str | None = None  # a sample's end, held until its calls are read
    stop_reason: str | None = None  # why it stopped, when a reason needs words (a grammar's end)
    detokenizer: IncrementalDetokenizer | None = None  # the server makes this choice's text


def _tool_deltas(delta: Json, found: Deltas) -> None:
    delta["text"] += found.content
    delta.setdefault("tool_calls", []).extend(found.calls)


def usage(stats: list[RequestStats]) -> Json:
    prompt = sum(s.prompt_tokens for s in stats)
    completion = sum(s.generated_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # From the prefix cache: prompt tokens whose K/V blocks were reused, not recomputed.
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_prompt_tokens for s in stats)},
    }


def timings(stats: list[RequestStats]) -> Json:
    """llama.cpp server's `timings`, from the engine's own clocks, with llama.cpp's meanings.
    prompt_*: the prompt tokens computed (cached ones are `cache_n`) over the prompt's
    processing, from the first step that ran the request to its first token (its chunks, and
    steps between them; not the time it queued); predicted_*: the tokens generated after the
    first, over the time from the first token to the last. Several prompts ran concurrently:
    counts add up, times are the longest."""
    cached = sum(s.cached_prompt_tokens for s in stats)
    prompt_n = sum(s.prompt_tokens for s in stats) - cached
    prompt_ms = max((s.prefill_s for s in stats), default=0.0) * 1000.0
    predicted_n = sum(s.generated_tokens for s in stats)
    predicted_ms = max((sum(s.itl_s) for s in stats), default=0.0) * 1000.0
    steps = sum(max(0, s.generated_tokens - 1) for s in stats)
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / (prompt_ms / 1000.0) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": steps / (predicted_ms / 1000.0) if predicted_ms > 0 else 0.0,
    }


class Reply:
    def __init__(
        self,
        kind: str,
        plan: Plan,
        started: list[Started],
        strings: TokenStrings,
        model: str,
        echoed: list[EchoedPrompt] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tool_format: ToolFormat | None = None,
        cancel: Callable[[int], None] = lambda request_id: None,
    ):
        self.kind = kind  # "chat" or "completion"
        self.plan = plan
        self.strings = strings
        self.model = model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = plan.sampling.n
        self.index_of = {s.request_id: i for i, s in enumerate(started)}
        self.request_ids = [s.request_id for s in started]
        self._cancel = cancel
        # Engine requests the server stopped (a stop string in its text), and the tokens each
        # made past its choices' ends: no part of the reply
        self.cut: set[int] = set()
        self.overflow: dict[int, int] = {}
        self.choices = [Choice() for _ in range(len(plan.prompts) * self.n)]
        if plan.tools is not None and tool_format is not None:
            for choice in self.choices:
                choice.tools = ToolStream(tool_format, plan.tools.constrained)
        self.stats: dict[int, RequestStats] = {}
        self.started: set[int] = set()
        self.error: ServeError | None = None
        self.echoed = echoed or []
        for i, prompt in enumerate(self.echoed):
            for branch in range(self.n):
                choice = self.choices[i * self.n + branch]
                choice.text = prompt.text
                choice.text_offset = len(prompt.text)
                choice.logprobs = list(prompt.entries)
                if plan.score_only:
                    choice.finish_reason = "length"  # vLLM's for a prompt scored with max_tokens 0
        if tokenizer is not None:
            for i, s in enumerate(started):
                for branch in range(self.n):
                    self.choices[i * self.n + branch].detokenizer = IncrementalDetokenizer(
                        tokenizer, s.prompt_tail, plan.sampling.stop
                    )

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.stats) == len(self.index_of)

    # ---- folding events --------------------------------------------------------------------
    def fold(self, events: Iterable[object]) -> list[Json]:
        """Fold a batch; returns the streaming chunks it makes (without the usage chunk)."""
        changed: dict[int, Json] = {}  # choice -> delta of this batch
        for event in events:
            request_id = getattr(event, "request_id", None)
            request_index = self.index_of.get(request_id) if request_id is not None else None
            if request_index is None:
                continue
            if isinstance(event, TokenGenerated):
                self._token(request_index, request_index * self.n + event.branch, event, changed)
            elif isinstance(event, ToolCallsParsed):
                self.choices[request_index * self.n + event.branch].parsed = event
            elif isinstance(event, SequenceFinished) and event.finish_reason in ("stop", "length", "grammar"):
                index = request_index * self.n + event.branch
                if self.choices[index].tools is not None:
                    self.choices[index].ended = event.finish_reason  # its calls are read at the request's end
                else:
                    self._finish(index, event.finish_reason, changed)
            elif isinstance(event, RequestFinished):
                self._request_finished(request_index, event, changed)
            elif isinstance(event, RequestStarted):
                self.started.add(event.request_id)
            elif isinstance(event, RequestFailed):
                if event.request_id in self.started:  # it ran and broke
                    self.error = ServeError(event.message, code="request_failed", status=500)
                else:  # the engine refused it (n over the batch, a group with speculation, ...)
                    self.error = ServeError(event.message, param_of(event.message), "invalid_request")
        return [self._chunk(index, delta) for index, delta in sorted(changed.items())]

    def _delta(self, changed: dict[int, Json], index: int) -> Json:
        return changed.setdefault(index, {"text": "", "logprobs": [], "finish_reason": None})

    def _token(self, request_index: int, index: int, token: TokenGenerated, changed: dict[int, Json]) -> None:
        choice = self.choices[index]
        if choice.finish_reason is not None:  # made after the stop string the server found
            request_id = self.request_ids[request_index]
            self.overflow[request_id] = self.overflow.get(request_id, 0) + 1
            return
        delta = self._delta(changed, index)
        self._token_text(choice, token, delta)
        self._token_logprobs(choice, token, delta)
        if choice.detokenizer is not None and choice.detokenizer.stopped:
            self._finish(index, "stop", changed)
            base = request_index * self.n
            if all(c.finish_reason is not None for c in self.choices[base : base + self.n]):
                request_id = self.request_ids[request_index]
                self.cut.add(request_id)
                self._cancel(request_id)

    def _token_text(self, choice: Choice, token: TokenGenerated, delta: Json) -> None:
        text_delta = token.text_delta
        if choice.detokenizer is not None:  # the server makes the text (no tools: see Plan.engine_text)
            text_delta = choice.detokenizer.push(token.token_id)
        if choice.tools is not None:
            # the format's special tokens (Mistral's [TOOL_CALLS]) are no part of the text delta
            marker = token.text if not text_delta and token.text in choice.tools.format.markers else ""
            found = choice.tools.push(text_delta or marker)
            choice.text += found.content
            _tool_deltas(delta, found)
        else:
            choice.text += text_delta
            delta["text"] += text_delta

    def _token_logprobs(self, choice: Choice, token: TokenGenerated, delta: Json) -> None:
        if self.plan.top_logprobs is None or token.snapshot is None:
            return
        token_text = token.text or self.strings.text_of(token.token_id)
        entry: LogprobEntry
        if self.kind == "chat":
            entry = self.strings.chat_entry(
                token.token_id, token_text, token.snapshot, self.plan.top_logprobs
            )
        else:
            top = {
                self.strings.text_of(i, token.snapshot): lp
                for i, lp in top_raw(token.snapshot, self.plan.top_logprobs)
            }
            entry = (token_text, raw_logprob(token.snapshot, token.token_id), top, choice.text_offset)
            choice.text_offset += len(token_text)
        choice.logprobs.append(entry)
        delta["logprobs"].append(entry)

    def _finish(self, index: int, reason: str, changed: dict[int, Json], note: str = "") -> None:
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return
        if choice.detokenizer is not None:
            rest = choice.detokenizer.flush()  # an incomplete character held back
            choice.text += rest
            self._delta(changed, index)["text"] += rest
        if reason == "grammar":  # the grammar permitted no next token: a stop, with its reason
            reason, choice.stop_reason = "stop", note or "the grammar permits no next token"
        if choice.tools is not None:
            found = choice.tools.finish(choice.parsed)
            choice.text += found.content
            _tool_deltas(self._delta(changed, index), found)
            if choice.tools.calls:
                reason = "tool_calls"
        choice.finish_reason = reason
        self._delta(changed, index)["finish_reason"] = reason

    def _request_finished(self, request_index: int, event: RequestFinished, changed: dict[int, Json]) -> None:
        self.stats[event.request_id] = self._reply_stats(event)
        if event.request_id in self.cut:  # every choice already ended, at its stop string
            return
        if event.finish_reason == "cancelled":
            self.error = ServeError("The request was cancelled: the server is shutting down.", status=503)
            return
        base = request_index * self.n
        if self.plan.sampling.beam_search and event.sequences:
            # Beams stream nothing while they search: the best one is the reply, all at once.
            best = event.sequences[0]
            choice = self.choices[base]
            if choice.tools is not None:
                found = choice.tools.push(best.text)
                choice.text += found.content
                _tool_deltas(self._delta(changed, base), found)
            else:
                choice.text += best.text
                self._delta(changed, base)["text"] += best.text
            self._finish(base, best.finish_reason, changed, event.note)
            return
        if event.sequences:
            for seq in event.sequences:
                choice = self.choices[base + seq.branch]
                self._finish(base + seq.branch, choice.ended or seq.finish_reason, changed, event.note)
        else:
            self._finish(base, event.finish_reason, changed, event.note)

    def _reply_stats(self, event: RequestFinished) -> RequestStats:
        """The engine's figures of the request, less the tokens it made past the reply's stop
        strings (and, where it stamped one gap per token, their gaps)."""
        stats, over = event.stats, self.overflow.get(event.request_id, 0)
        if not over:
            return stats
        itl = stats.itl_s
        if len(itl) == stats.generated_tokens - 1:
            itl = itl[: max(0, len(itl) - over)]
        return replace(stats, generated_tokens=stats.generated_tokens - over, itl_s=itl)

    # ---- chunks and bodies -----------------------------------------------------------------
    def _head(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self) -> Json:
        """Chat streams open with the assistant role for every choice."""
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(self.choices))
        ]
        return self._with_usage_slot(chunk)

    def echo_chunk(self) -> Json | None:
        if not self.echoed:
            return None
        chunk = self._head("text_completion")
        chunk["choices"] = [
            {
                "index": i,
                "text": c.text,
                "logprobs": self._logprobs_object(c.logprobs) if self.plan.top_logprobs is not None else None,
                "finish_reason": None,
            }
            for i, c in enumerate(self.choices)
        ]
        return self._with_usage_slot(chunk)

    def _chunk(self, index: int, delta: Json) -> Json:
        logprobs = None
        if self.plan.top_logprobs is not None and delta["logprobs"]:
            logprobs = self._logprobs_object(delta["logprobs"])
        if self.kind == "chat":
            body: Json = {"content": delta["text"]} if delta["text"] or logprobs else {}
            if delta.get("tool_calls"):
                body["tool_calls"] = delta["tool_calls"]
            choice = {
                "index": index,
                "delta": body,
                "logprobs": logprobs,
                "finish_reason": delta["finish_reason"],
            }
            self._extras(choice, self.choices[index], delta["finish_reason"] is not None)
            chunk = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": index,
                "text": delta["text"],
                "logprobs": logprobs,
                "finish_reason": delta["finish_reason"],
            }
            self._extras(choice, self.choices[index], delta["finish_reason"] is not None)
            chunk = self._head("text_completion")
        chunk["choices"] = [choice]
        if self.done and all(c.finish_reason for c in self.choices):
            chunk["timings"] = timings(list(self.stats.values()))
        return self._with_usage_slot(chunk)

    @staticmethod
    def _extras(out: Json, choice: Choice, ended: bool) -> None:
        """The reasons that need words: vLLM's `stop_reason`; a call that did not parse."""
        if not ended:
            return
        if choice.stop_reason:
            out["stop_reason"] = choice.stop_reason
        if choice.tools is not None and choice.tools.error:
            out["tool_call_error"] = choice.tools.error

    def _message(self, choice: Choice) -> Json:
        calls = choice.tools.final_calls() if choice.tools is not None else ()
        message: Json = {"role": "assistant", "content": choice.text if choice.text or not calls else None}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        return message

    def _with_usage_slot(self, chunk: Json) -> Json:
        if self.plan.include_usage:
            chunk["usage"] = None  # as OpenAI streams it: null until the final usage chunk
        return chunk

    def _usage(self) -> Json:
        if self.plan.score_only:  # nothing ran as a request: the prompts were scored
            tokens = sum(e.tokens for e in self.echoed)
            return {
                "prompt_tokens": tokens,
                "completion_tokens": 0,
                "total_tokens": tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        return usage(list(self.stats.values()))

    def usage_chunk(self) -> Json:
        chunk = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = self._usage()
        chunk["timings"] = timings(list(self.stats.values()))
        return chunk

    def _logprobs_object(self, entries: list[LogprobEntry]) -> Json:
        if self.kind == "chat":
            return {"content": list(entries)}
        rows = cast("list[CompletionEntry]", entries)  # a completion's entries are all tuples
        return {
            "tokens": [e[0] for e in rows],
            "token_logprobs": [e[1] for e in rows],
            "top_logprobs": [e[2] for e in rows],
            "text_offset": [e[3] for e in rows],
        }

    def body(self) -> Json:
        """The whole non-streaming response."""
        if self.kind == "chat":
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": i,
                    "message": self._message(c),
                    "logprobs": None if self.plan.top_logprobs is None else {"content": c.logprobs},
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(self.choices)
            ]
            for out, c in zip(body["choices"], self.choices):
                self._extras(out, c, True)
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": None if self.plan.top_logprobs is None else self._logprobs_object(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(self.choices)
            ]
            for out, c in zip(body["choices"], self.choices):
                self._extras(out, c, True)
        stats = list(self.stats.values())
        body["usage"] = self._usage()
        body["timings"] = timings(stats)
        return body
