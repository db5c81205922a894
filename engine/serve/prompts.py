"""Prompts made into token ids off the engine thread, with back-pressure.

Rendering a chat template and tokenizing take time that grows with the prompt (about a second
for a few MB of text): done on the engine thread, between two steps, one huge prompt would stall
every stream. Here they run on a small pool of threads of their own. The queue is bounded: past
`max_waiting` requests accepted but not yet running (being tokenized, or waiting in the engine's
queue), a new one is refused with 429 and `Retry-After`, so a flood of clients costs the server
a bounded amount of memory and time instead of growing a queue nobody will see the end of.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.serve.errors import ServeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.serve.params import Prompt

RETRY_AFTER_S = 1
# Two, so one huge prompt does not hold up the next request's small one. A fast tokenizer may be
# used by several threads while none changes its truncation or padding, which kvscope never does.
TOKENIZER_THREADS = 2


class Overloaded(ServeError):
    """429: the waiting queue is full; `retry_after_s` goes out as the Retry-After header."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message, None, "too_many_requests", 429)
        self.retry_after_s = retry_after_s


class PromptQueue:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_waiting: int,
        engine_waiting: Callable[[], int],
        threads: int = TOKENIZER_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self._engine_waiting = engine_waiting  # requests in the engine's waiting queue now
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvscope-tokenize")
        self._lock = threading.Lock()
        self._pending = 0  # admitted here, not yet handed to the engine

    @property
    def pending(self) -> int:
        return self._pending

    def admit(self, count: int = 1) -> None:
        """Take `count` places in the queue, or raise Overloaded (429)."""
        with self._lock:
            waiting = self._pending + self._engine_waiting()
            if waiting + count > self.max_waiting:
                raise Overloaded(
                    f"The server is busy: {waiting} requests are waiting (at most {self.max_waiting}). "
                    f"Retry in {RETRY_AFTER_S} s."
                )
            self._pending += count

    def leave(self, count: int = 1) -> None:
        """`count` admitted requests were handed to the engine (or given up)."""
        with self._lock:
            self._pending = max(0, self._pending - count)

    async def token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's ids, computed on the pool (raises what the chat template raises)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, prompt.token_ids, self.tokenizer)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
