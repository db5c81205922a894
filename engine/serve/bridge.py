"""The one engine thread behind the HTTP server, and the routing of its events.

Every HTTP request becomes engine requests on the same `engine.core.service.Engine`, so
concurrent clients are batched into the same steps like the app's chat tabs. The engine's sink
(`_on_event`, on the engine thread) does three cheap things per event: feed the Prometheus
metrics, hand request events to the channel of the HTTP request that owns them, and hand every
event to the `/v1/kvscope/events` subscribers. Requests are started and subscribers registered
inside `Engine.call`, on the engine thread between two steps, so no event can slip between a
registration and the state it starts from. A request reaches the engine thread as token ids,
already checked: its tokenization ran on the prompt pool (engine.serve.prompts).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from engine.config import EngineConfig, SamplingParams
from engine.core.scoring import score_ids
from engine.core.service import Engine
from engine.events import Event, ModelInfo
from engine.inside import TextScore
from engine.request import Request
from engine.serve.channel import Channel
from engine.serve.codec import RequestTagged
from engine.serve.logprobs import token_bytes_table
from engine.serve.metrics import ServeMetrics
from engine.serve.params import Bounds
from engine.serve.prompts import PromptQueue
from engine.serve.snapshot import state_events
from engine.text.detokenize import PROMPT_CONTEXT_TOKENS
from engine.tools.render import tool_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core.llm_engine import LLMEngine
    from engine.limits import Limits
    from engine.model.loaded import LoadedModel
    from engine.serve.tool_request import ToolRequest
    from engine.tools.formats import ToolFormat

T = TypeVar("T")

# A subscriber more than this many events behind is cut off (it reconnects for a new snapshot):
# minutes of a busy engine's events, and a bound on what a stalled client can cost the server.
SUBSCRIBER_LIMIT = 200_000
# Requests accepted but not yet running (tokenizing, or in the engine's waiting queue) before a
# new one gets 429: a few minutes of work for a small model, and a bound on a flood's cost.
DEFAULT_MAX_WAITING = 256
# Request bodies past this many bytes get 413 (engine.serve.guards); a 128k-token prompt is well
# under 1 MiB of text.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True, slots=True)
class Started:
    request_id: int
    prompt_tokens: int
    prompt_tail: tuple[int, ...] = ()  # the prompt's last ids: the server's detokenizer's context


class EngineBridge:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        model_name: str | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        self.config = config
        self.engine = Engine(config, sink=self._on_event, loaded=loaded)
        self._model_name = model_name
        self.max_waiting = max_waiting
        self.prompts: PromptQueue | None = None
        self.bounds: Bounds | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.limits: Limits | None = None  # the engine's (engine.limits), read once it loaded
        self.metrics: ServeMetrics | None = None
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._subscribers: set[Channel] = set()
        self._ids = itertools.count(1)
        self.max_model_len = 0
        self.token_bytes: list[bytes] = []
        self.tool_format: ToolFormat | None = None  # how the model writes calls (read at start)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Load the model (on the engine thread) and wait for it; raises with the load error."""
        self.engine.start()
        info = self.engine.info if self.engine.wait_until_loaded(timeout) else None
        if info is None:
            raise RuntimeError(self.engine.load_error or "the model did not load in time")
        self.model_name = self._model_name or info.name
        self.max_model_len, self.token_bytes, self.tokenizer, self.limits, self.tool_format = (
            self.engine._call(
                lambda core: (
                    core.limits.context_window,
                    token_bytes_table(core.tokenizer),
                    core.tokenizer,
                    core.limits,
                    tool_template(core.tokenizer).format,
                )
            ).result()
        )
        self.metrics = ServeMetrics(self.model_name, self.max_model_len)
        self.bounds = Bounds(info.vocab_size, self.max_model_len, self.config.max_num_seqs)
        self.prompts = PromptQueue(self.tokenizer, self.max_waiting, self.engine_waiting)

    def engine_waiting(self) -> int:
        """Requests in the engine's waiting queue now (a deque's length: safe to read from any
        thread; one step stale at worst)."""
        core = self.engine.core
        return len(core.scheduler.waiting) if core is not None else 0

    def shutdown(self) -> None:
        if self.prompts is not None:
            self.prompts.shutdown()
        self.engine.shutdown()

    @property
    def info(self) -> ModelInfo | None:
        return self.engine.info

    # ---- the sink (engine thread) ----------------------------------------------------------
    def _on_event(self, event: Event) -> None:
        if self.metrics is not None:
            self.metrics.observe(event)
        rid = getattr(event, "request_id", None)
        with self._lock:
            channel = self._channels.get(rid) if rid is not None else None
            subscribers = tuple(self._subscribers)
        if channel is not None:
            channel.push(event)
        for subscriber in subscribers:
            subscriber.push(event)

    # ---- requests --------------------------------------------------------------------------
    async def start_request(
        self,
        ids: list[int],
        sampling: SamplingParams,
        channel: Channel,
        tag: str | None = None,
        arrival: float | None = None,
        detokenize: bool = True,
        tools: ToolRequest | None = None,
    ) -> Started:
        """Start a request of checked prompt ids on the engine thread; its events go to
        `channel`. `detokenize` False: the engine makes no text for it, and the server finds its
        stop strings in the text it makes (serve/replies.py), so the engine is not given them."""
        request_id = next(self._ids)
        if not detokenize:
            sampling = replace(sampling, stop=())
        arrived = time.perf_counter() if arrival is None else arrival

        def begin(core: LLMEngine) -> Started:
            with self._lock:
                self._channels[request_id] = channel
                subscribers = tuple(self._subscribers) if tag else ()
            if tag:
                for subscriber in subscribers:
                    subscriber.push(RequestTagged(request_id, tag, time.perf_counter()))
            assert self.metrics is not None, "requests are served after start()"
            self.metrics.arrived(request_id, arrived, sampling.n, sampling.max_new_tokens)
            request = Request(prompt_token_ids=tuple(ids), sampling=sampling, detokenize=detokenize)
            if tools is not None:  # the prompt renders them; the reply is read for calls
                request = Request(
                    prompt_token_ids=tuple(ids),
                    sampling=sampling,
                    detokenize=detokenize,
                    tools=tools.tools,
                    tool_choice=tools.tool_choice,
                    tool_name=tools.tool_name,
                    parallel_tool_calls=tools.parallel_tool_calls,
                )
            core.add_request(request, request_id)
            return Started(request_id, len(ids), tuple(ids[-PROMPT_CONTEXT_TOKENS:]))

        return await asyncio.wrap_future(self.engine._call(begin))

    async def score_prompt(self, ids: list[int], top_k: int) -> tuple[str, TextScore | None]:
        """A completion prompt's token ids (tokenized and checked): its text as the tokens decode
        and, with `top_k` >= 0, every token scored under the ones before it on the engine thread
        (engine/core/scoring.py: log-probs, ranks, the top `top_k`)."""

        def score(core: LLMEngine) -> tuple[str, TextScore | None]:
            text = str(core.tokenizer.decode(ids))
            return text, (score_ids(core, ids, top_k) if top_k >= 0 else None)

        return await asyncio.wrap_future(self.engine._call(score))

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)

    def release(self, request_id: int) -> None:
        """The HTTP side is done with the request (its end was read, or it was cancelled)."""
        with self._lock:
            self._channels.pop(request_id, None)

    # ---- the events stream -----------------------------------------------------------------
    async def subscribe(self, loop: asyncio.AbstractEventLoop) -> Channel:
        """A channel that starts with the engine's current state, then every event. (A client
        that reconnects gets a new snapshot; the tags of requests already running are not in it,
        so an attached app stops its own replies when its stream breaks.)"""
        channel = Channel(loop, SUBSCRIBER_LIMIT)

        def attach(core: LLMEngine) -> None:
            channel.push_many(state_events(core))
            with self._lock:
                self._subscribers.add(channel)

        await asyncio.wrap_future(self.engine._call(attach))
        return channel

    def unsubscribe(self, channel: Channel) -> None:
        with self._lock:
            self._subscribers.discard(channel)
