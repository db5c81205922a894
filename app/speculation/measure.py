"""The speedup of speculative decoding, measured: the same prompt and settings run through the
engine with and without speculation, one after the other, on the loaded model.

Both runs ignore EOS and generate the same number of tokens, so their tokens/s compare like for
like; a short warm-up first keeps one-off costs (first kernels, allocator growth) out of both.
Runs on the engine thread (EngineHost.call), the only thread that may use the engine's model: a
chat reply sent meanwhile waits until it is done, so nothing else shares the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished, RequestStats
from engine.request import Request

# Enough tokens for a stable rate on CPU, few enough that the measurement takes seconds.
MEASURE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SpeedRun:
    tokens: int
    seconds: float
    stats: RequestStats  # of the run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SpeedupResult:
    proposer: str
    speculative: SpeedRun
    plain: SpeedRun

    @property
    def speedup(self) -> float:
        return self.speculative.tokens_per_s / self.plain.tokens_per_s if self.plain.tokens_per_s else 0.0


def _run(loaded, config: EngineConfig, request: Request) -> SpeedRun:
    events: list = []
    engine = LLMEngine(loaded, config, events.append)
    engine.add_request(request)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    done = next(e for e in events if isinstance(e, RequestFinished))
    return SpeedRun(len(done.token_ids), seconds, done.stats)


def measure_speedup(
    loaded, config: EngineConfig, speculative: SpeculativeConfig, request: Request, progress=lambda _m: None
) -> SpeedupResult:
    """Tokens/s of `request` under `config` with `speculative` and with no speculation."""
    sampling = replace(
        request.sampling, max_new_tokens=min(request.sampling.max_new_tokens, MEASURE_TOKENS), ignore_eos=True
    )
    request = replace(request, sampling=sampling)
    plain_config = replace(config, speculative=None)
    spec_config = replace(config, speculative=speculative)
    progress("warming up")
    _run(loaded, plain_config, replace(request, sampling=replace(sampling, max_new_tokens=4)))
    progress("without speculation")
    plain = _run(loaded, plain_config, request)
    progress(f"with {speculative.method} speculation")
    spec = _run(loaded, spec_config, request)
    return SpeedupResult(speculative.method, spec, plain)
