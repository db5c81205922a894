"""A request timed to its end on a fresh engine, and the speedup of speculative decoding measured
with it: the same prompt and settings with and without speculation, one after the other, on one
loaded model. The app's "Measure speedup" and `engine bench --speculation` both measure here.

Both runs ignore EOS and generate the same number of tokens, so their tokens/s compare like for
like; a short warm-up first keeps one-off costs (first kernels, allocator growth) out of both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine, RequestError
from engine.events import RequestFailed, RequestFinished
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.results import SpeedRun, SpeedupResult

# Enough tokens for a stable rate on CPU, few enough that the measurement takes seconds.
MEASURE_TOKENS = 64
WARM_UP_TOKENS = 4


def timed_run(
    loaded: LoadedModel, config: EngineConfig, request: Request
) -> tuple[RequestFinished, SpeedRun]:
    """`request` alone on a fresh engine for `loaded`, stepped to its end: its end and its speed
    (tokens over the wall time from its submission to its last token)."""
    return timed_request(LLMEngine(loaded, config), request)


def timed_request(engine: LLMEngine, request: Request) -> tuple[RequestFinished, SpeedRun]:
    """`request` on `engine`, nothing else in flight, stepped to its end: as `timed_run`, on an
    engine that keeps what earlier requests taught it (the draft tuner's measured costs and
    acceptance), as the app's and the server's engines do."""
    start = time.perf_counter()
    (end,) = engine.run([request])
    seconds = time.perf_counter() - start
    if isinstance(end, RequestFailed):
        raise RequestError(end.message)
    return end, SpeedRun(len(end.token_ids), seconds, end.stats)


def measure_speedup(
    loaded: LoadedModel,
    config: EngineConfig,
    speculative: SpeculativeConfig,
    request: Request,
    progress: Callable[[str], None] = lambda _message: None,
) -> SpeedupResult:
    """Tokens/s of `request` under `config` with `speculative` and with no speculation, at most
    MEASURE_TOKENS of them, EOS ignored."""
    sampling = replace(
        request.sampling, max_new_tokens=min(request.sampling.max_new_tokens, MEASURE_TOKENS), ignore_eos=True
    )
    request = replace(request, sampling=sampling)
    plain_config = replace(config, speculative=None)
    progress("warming up")
    timed_run(
        loaded, plain_config, replace(request, sampling=replace(sampling, max_new_tokens=WARM_UP_TOKENS))
    )
    progress("without speculation")
    _, plain = timed_run(loaded, plain_config, request)
    progress(f"with {speculative.method} speculation")
    _, spec = timed_run(loaded, replace(config, speculative=speculative), request)
    return SpeedupResult(speculative.method, spec, plain)
