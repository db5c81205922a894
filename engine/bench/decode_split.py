"""Where a decode token's time goes: matmuls, attention, the rest of the forward, sampling, events.

Measured, not estimated: for one instrumented run the bench wraps the engine's own pieces with
timers (every kernel layer's call, the paged attention call, the sampler, the event sink), steps a
greedy request, and splits each decode step's wall time. Layers that run as one C call each
(engine/model/fused_layers.py) time their matmuls and attention inside it. The wrappers cost a little themselves
(two clock reads per call, ~120 calls a token), so the split is taken on its own run, never on
the rounds whose speed is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

import engine.model.llama_forward as forward_module
import engine.model.paged_attention as attention_module
from engine.config import SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import Event, StepStats
from engine.kernels.linear import KernelLinear
from engine.request import Request

R = TypeVar("R")


@dataclass(slots=True)
class _Clock:
    totals: dict[str, float] = field(default_factory=dict)

    def wrap(self, name: str, fn: Callable[..., R]) -> Callable[..., R]:
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()  # in place: the wrappers hold this dict
        return out


class FusedClock:
    """The fused layers' own timers (engine/model/fused_layers.py): their matmuls and attention
    run inside one C call a layer, where the Python wrappers cannot see them."""

    def __init__(self, engine: LLMEngine):
        own = engine.runner.own_forward
        self.fused = own.fused if own is not None else None
        if self.fused is not None:
            self.fused.clock = np.zeros(3)

    def take(self) -> tuple[float, float]:
        """Seconds in (matmuls, attention) since the last take."""
        clock = self.fused.clock if self.fused is not None else None
        if clock is None:
            return 0.0, 0.0
        matmuls, attention = float(clock[0]), float(clock[1])
        clock[:] = 0.0
        return matmuls, attention

    def close(self) -> None:
        if self.fused is not None:
            self.fused.clock = None


def decode_split(engine: LLMEngine, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """Median milliseconds per decode step (one sequence, so per token) in each part."""
    clock = _Clock()
    restore: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)
        restore.append((owner, name, original))
        setattr(owner, name, clock.wrap(part, original))

    for module in engine.loaded.model.modules():
        if isinstance(module, KernelLinear):
            patch(module, "forward", "matmuls")
    patch(forward_module, "attend", "attention")
    patch(attention_module, "attend", "attention")
    patch(engine.post, "sample", "sampling")
    fused = FusedClock(engine)
    steps: list[tuple[StepStats, dict[str, float]]] = []
    sink = engine.sink
    events_s = [0.0]

    def timed_sink(event: Event) -> None:
        start = time.perf_counter()
        sink(event)
        events_s[0] += time.perf_counter() - start
        if isinstance(event, StepStats):
            parts = clock.take()
            for name, seconds in zip(("matmuls", "attention"), fused.take()):
                parts[name] = parts.get(name, 0.0) + seconds
            parts["events"], events_s[0] = events_s[0], 0.0
            steps.append((event, parts))

    engine.sink = timed_sink  # every event of the engine passes here
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        engine.run([Request(prompt_token_ids=tuple(prompt_ids), sampling=params)])
    finally:
        engine.sink = sink
        fused.close()
        for owner, name, original in restore:
            if isinstance(owner, KernelLinear):
                del owner.forward  # the instance attribute: back to the class's method
            else:
                setattr(owner, name, original)
    decode = [(s, p) for s, p in steps if s.decode_tokens == 1 and not s.prefill_tokens]
    if not decode:
        return {}
    rows = []
    for stats, parts in decode:
        matmuls, attention = parts.get("matmuls", 0.0), parts.get("attention", 0.0)
        sampling, events = parts.get("sampling", 0.0), parts.get("events", 0.0)
        rest = max(0.0, stats.forward_s - matmuls - attention)
        rows.append((stats.duration_s, matmuls, attention, rest, sampling, events))
    names = ("step", "matmuls", "attention", "rest_of_forward", "sampling", "events")
    split = {f"{n}_ms": statistics.median(r[i] for r in rows) * 1000 for i, n in enumerate(names)}
    split["outside_matmuls_ms"] = split["step_ms"] - split["matmuls_ms"]
    return split
