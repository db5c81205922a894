"""The engine's front door: the one engine module the app imports, beside the shared vocabulary
(engine.config, engine.events, engine.request, engine.units; import-linter holds it).

`EngineClient` is everything the app asks of an engine: its requests (submit, cancel, run), its
events (the sink they go to), its lifecycle, and named, typed questions whose answers come in a
Future (a prompt's count, the limits, decoding, the device, a what-if, a measured speedup...). The
local engine (engine.core.service.Engine) answers them on its thread between two steps; the
remote one (app.remote.engine.RemoteEngine) over HTTP where a server can, and with a failed
Future saying so where it cannot. `tests/app/test_engine_client.py` holds both to the protocol,
names and signatures.

Below it, what the app needs beside an engine, run on its own workers: inspecting a model, the
models on this machine, the Hub, the quantization schemes here, the device's cached limits, the
sweeps and the quality runs, and the CLI the frozen bundle runs.

Importing this module costs no torch (the app reads it before its window shows, and before it
has set the offline environment): what needs torch or transformers is imported by the function
that needs it, each import saying so.

Adding a question (prompt log-probs, a logit lens, attention per head, a grammar check...):
1. declare it on `EngineClient` below: a method with typed arguments returning `Future[Answer]`,
   the answer a plain dataclass of the vocabulary (engine.results, engine.events), never a
   tensor or a model;
2. compute it in the engine: a function of the synchronous engine in engine/core/queries.py (or
   a module of its own beside it), and a method of engine.core.service.Engine that runs it with
   `self._call(lambda core: ...)`, which answers between two steps on the engine thread;
3. give app.remote.engine.RemoteEngine the same method: over the server's API when a kvscope
   server can answer it, else `self._unavailable("what it is")` (a failed Future whose message
   says it needs the engine in this app);
4. the protocol test then checks the three agree; the app asks through `EngineHost.ask`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.config import EngineConfig, GrammarSpec, ModelSpec, SamplingParams, SpeculativeConfig
from engine.core.gc_heap import set_collector as set_garbage_collector
from engine.errors import InspectionError, MeasurementError, ModelLoadError
from engine.events import Event, RequestEnd, TokenSnapshot
from engine.hub.cache import CachedModel, delete_cached, find_local_models, list_cached
from engine.hub.download import DownloadProgress, DownloadResult, download_files
from engine.hub.online import HubError, offline_by_default
from engine.hub.search import ModelHit, search_models
from engine.inside import ControlVector, ExpertRoutes, Steered, TextScore, TokenInside, WhatIfAnswer
from engine.limits import POLICIES, ContextFit, Limits, Refusal, fit, reply_room
from engine.model.local_models import LocalModel, gpt4all_models, lmstudio_models, ollama_models
from engine.model.runtime_memory import estimate_process, give_back_freed_memory
from engine.model.sources import hf_cache_dir, repo_file_of, with_gguf_file
from engine.private import create_private_file, private_dir
from engine.request import ChatMessage, Request, ToolSpec
from engine.resources import resource
from engine.results import (
    DeviceLimits,
    DeviceStatus,
    QualityReport,
    SpeedFigures,
    SpeedRun,
    SpeedupResult,
    Tokens,
)
from engine.serve.codec import RequestTagged
from engine.serve.codec import decode as decode_events
from engine.shapes import DTYPE_BYTES, KV_INT8_SCALE_BYTES, kv_bytes_per_token

if TYPE_CHECKING:
    from engine.bench.quality_run import QualityRun
    from engine.hub.files import RepoFiles
    from engine.model.loaded import LoadedModel
    from engine.quant.schemes import SchemeStatus

__all__ = [
    "DTYPE_BYTES",
    "KV_INT8_SCALE_BYTES",
    "POLICIES",
    "CachedModel",
    "ContextFit",
    "DeviceLimits",
    "DeviceStatus",
    "DownloadProgress",
    "DownloadResult",
    "EngineClient",
    "HubError",
    "InspectionError",
    "Limits",
    "LoadedModel",
    "LocalModel",
    "MeasurementError",
    "ModelHit",
    "ModelLoadError",
    "QualityReport",
    "Refusal",
    "RequestTagged",
    "SpeedFigures",
    "SpeedRun",
    "SpeedupResult",
    "Tokens",
    "check_grammar",
    "check_scheme_name",
    "create_private_file",
    "cli_main",
    "command_names",
    "compare_dtypes",
    "decode_events",
    "delete_cached",
    "device_limits_cached",
    "download_files",
    "estimate_process",
    "find_local_models",
    "fit",
    "give_back_freed_memory",
    "gpt4all_models",
    "hf_cache_dir",
    "inspect_model",
    "kv_bytes_per_token",
    "list_cached",
    "lmstudio_models",
    "local_engine",
    "measure_quality",
    "offline_by_default",
    "private_dir",
    "ollama_models",
    "reply_room",
    "repo_file_of",
    "repo_files",
    "resource",
    "scheme_statuses",
    "search_models",
    "set_garbage_collector",
    "what_if_notes",
    "with_gguf_file",
]

Progress = Callable[[str], None]


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the app drives it: in this process, or a server it is attached to. Every
    method may be called from any thread; none blocks on the engine's work."""

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model (or connect) on the engine's own thread; events say how it goes."""
        ...

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """Block until loaded (True), or until loading failed or `timeout` passed (False)."""
        ...

    @property
    def load_error(self) -> str | None:
        """Why loading failed, in one line (None while loading, or once loaded)."""
        ...

    def is_alive(self) -> bool:
        """The engine's thread still runs."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel everything, stop and join the engine's thread."""
        ...

    # ---- requests and their events -----------------------------------------------------------
    @property
    def events(self) -> Callable[[Event], None]:
        """Where the engine's events go, in order (the sink it was made with; it never blocks)."""
        ...

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id at once. Its events carry that id."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def run(self, requests: Sequence[Request]) -> Future[list[RequestEnd]]:
        """Submit `requests`; the Future holds each one's end, in order, once all have ended."""
        ...

    # ---- questions, answered between two steps -------------------------------------------------
    def count_prompt(self, request: Request) -> Future[int]:
        """Tokens of the request's prompt as the engine renders it (its chat template)."""
        ...

    def limits(self) -> Future[Limits]:
        """What this engine can hold: its context window, its KV pool, its batch."""
        ...

    def prompt_spans(self, request: Request) -> Future[tuple[tuple[int, int], ...]]:
        """Where each tool message's content sits in the request's prompt, as token positions
        [start, end) ((-1, -1) for one the template leaves out): the KV blocks a tool's result
        went into are the request's blocks over those positions."""
        ...

    def fit_context(
        self,
        head: Sequence[ChatMessage],
        history: Sequence[ChatMessage],
        tail: Sequence[ChatMessage],
        max_new_tokens: int,
        policy: str,
        prefix_ids: Sequence[int] = (),
        tail_is_new: bool = True,
        tools: Sequence[ToolSpec] = (),
    ) -> Future[ContextFit]:
        """How much of a conversation fits (engine.limits.fit), counted by the engine (with the
        `tools` it offers rendered into the prompt)."""
        ...

    def decode(self, token_ids: Sequence[int], after: Sequence[int] = ()) -> Future[str]:
        """The text `token_ids` add after `after`, as a reply's stream would decode them."""
        ...

    def tokens_of(self, pieces: Sequence[str | int]) -> Future[list[Tokens]]:
        """Each text (or token id, checked against the vocabulary) in the model's tokens."""
        ...

    def device(self) -> Future[DeviceStatus]:
        """The loaded model's device and the memory left on it now."""
        ...

    def device_limits(self, refresh: bool = False) -> Future[DeviceLimits]:
        """The device's measured roofs in the model's dtype (cached, or measured now)."""
        ...

    def what_if(
        self, request: Request, output_ids: Sequence[int], recorded: TokenSnapshot, params: SamplingParams
    ) -> Future[WhatIfAnswer]:
        """A generated token's stages recomputed exactly under other settings, on the step's own
        logits when they are still kept, else on logits recomputed through the paged forward (the
        answer says which)."""
        ...

    # ---- the model's inside, on demand for one token or one text (engine.inside's answers) ------
    def inspect_token(
        self, request: Request, output_ids: Sequence[int], token_id: int, top_k: int = 5
    ) -> Future[TokenInside]:
        """The logit lens and every head's attention of the step that drew `token_id` after the
        request's prompt and the reply's `output_ids`, recomputed through the paged forward over
        the blocks it read."""
        ...

    def expert_routes(self, request: Request, output_ids: Sequence[int]) -> Future[ExpertRoutes]:
        """Which experts each token of the prompt and the reply was routed to, per MoE layer, and
        the load per expert over the reply (InspectionError for a dense model)."""
        ...

    def score_text(self, text: str, top_k: int = 5) -> Future[TextScore]:
        """Every token of `text` under the model: its log-probability, rank and the likeliest
        tokens there, and the perplexity (InspectionError past the context)."""
        ...

    def read_control_vector(self, path: str) -> Future[ControlVector]:
        """A control vector file in llama.cpp's GGUF format, checked against the loaded model."""
        ...

    def contrast_vector(self, positive: str, negative: str) -> Future[ControlVector]:
        """A control vector computed from two contrasting prompts (per layer, the difference of
        their last tokens' residual streams)."""
        ...

    def steer(
        self,
        request: Request,
        output_ids: Sequence[int],
        vector: ControlVector,
        layer: int | None,
        strength: float,
        top_n: int = 10,
    ) -> Future[Steered]:
        """The next token's distribution after the request's prompt and `output_ids`, without and
        with `vector` (times `strength`) added after `layer` (None: every layer it has)."""
        ...

    def measure_speedup(
        self, request: Request, speculative: SpeculativeConfig, progress: Callable[[str], None]
    ) -> Future[SpeedupResult]:
        """Tokens/s of `request` with and without `speculative`, on the loaded model."""
        ...

    def loaded_model(self) -> Future[LoadedModel]:
        """The loaded model, for the next engine to start on without loading it again (opaque:
        the app hands it back to `local_engine`, never looks inside)."""
        ...


# ---- starting an engine ----------------------------------------------------------------------
def local_engine(
    config: EngineConfig, sink: Callable[[Event], None], loaded: LoadedModel | None = None
) -> EngineClient:
    """An engine in this process for `config`, its events into `sink`; `start()` loads it on its
    thread (or starts on `loaded`, another engine's model)."""
    # the engine's service: its torch loads on the engine thread, not here
    from engine.core.service import Engine

    return Engine(config, sink=sink, loaded=loaded)


# ---- beside an engine: models, their fit, the machine ------------------------------------------
def inspect_model(
    source: str,
    dtype: str = "float32",
    context: int | None = None,
    budget_gib: float | None = None,
    quantization: str = "auto",
) -> dict[str, Any]:
    """A source's shapes and memory at a context, without loading weights (engine.model.inspect)."""
    # torch and transformers: on the worker that asks, not at the app's start
    from engine.model.inspect import inspect_model as inspect

    return inspect(source, dtype, context, budget_gib, quantization)


def repo_files(
    repo_id: str, dtype: str = "bfloat16", context: int | None = 4096, budget_gib: float | None = None
) -> RepoFiles:
    """A Hub repo's weight files with the fit of each (engine.hub.files)."""
    # torch (the fit estimates): on the worker that asks
    from engine.hub.files import repo_files as files

    return files(repo_id, dtype, context, budget_gib)


def scheme_statuses(device: str) -> list[SchemeStatus]:
    """Every weight quantization scheme and whether it runs on `device` here, with the reason."""
    # torch: on the worker that asks
    from engine.quant.schemes import scheme_statuses as statuses

    return statuses(device)


def check_scheme_name(name: str) -> None:
    """A ConfigError naming the choices when `name` is no quantization scheme."""
    # torch (the schemes' modules): only for a name given on the command line
    from engine.quant.schemes import get_scheme

    get_scheme(name)


def device_limits_cached(device: str, dtype: str) -> bool:
    """Limits for `device` in `dtype` were measured on this machine before (reading them is quick)."""
    # torch: the device's name
    import torch

    from engine.measure.device_limits import cache_path

    return cache_path(torch.device(device), dtype).exists()


def compare_dtypes(
    source: str,
    dtypes: list[str],
    prompt_lengths: list[int],
    context_lengths: list[int],
    device: str = "auto",
    decode_tokens: int = 8,
    repeats: int = 2,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The latency sweep across dtypes on copies of a model it loads itself (engine.bench.sweep)."""
    # torch: on the worker that runs the sweep
    from engine.bench.sweep import compare_dtypes as sweep

    return sweep(source, dtypes, prompt_lengths, context_lengths, device, decode_tokens, repeats, progress)


def measure_quality(
    spec: ModelSpec,
    kv_dtype: str,
    messages: Sequence[ChatMessage] | None,
    reply_ids: Sequence[int] = (),
    reply_prompt_tokens: int | None = None,
    speed_tokens: int = 0,
    progress: Progress = lambda _text: None,
    cancelled: Callable[[], bool] = lambda: False,
    candidates: Sequence[Sequence[int]] = (),
) -> QualityRun | None:
    """The running scheme against full precision on a conversation (`messages`, with the reply's
    exact tokens when given) or the shipped evaluation text (`messages` None), on copies of the
    model it loads itself (engine.bench.quality_run). None when `cancelled()` turned true."""
    # torch: on the worker that runs the comparison
    from engine.bench.quality_run import measure_quality as measure

    return measure(
        spec,
        kv_dtype,
        messages,
        reply_ids,
        reply_prompt_tokens,
        speed_tokens,
        progress,
        cancelled,
        candidates,
    )


def check_grammar(spec: GrammarSpec) -> str:
    """Why a structured-output setting cannot be used, in one line ("" when it can): the grammar
    or schema checked by the library that will apply it (quick: the app checks as you type)."""
    # llguidance and jsonschema (no torch): only once a chat asks for structured output
    from engine.grammar.compile import GrammarError, check

    try:
        check(spec)
    except GrammarError as exc:
        return str(exc)
    return ""


def what_if_notes(params: SamplingParams) -> tuple[str, ...]:
    """How a what-if under `params` differs from what one real draw would show."""
    # torch (the what-if's module): by then loaded by the engine in this process
    from engine.core.what_if import what_if_notes as notes

    return notes(params)


# ---- the CLI the frozen bundle runs ------------------------------------------------------------
def command_names() -> tuple[str, ...]:
    """The headless CLI's commands (`kvscope generate ...` runs them, as `python -m engine`)."""
    from engine.cli.main import command_names as names  # the CLI's parser: light, but not needed to start

    return names()


def cli_main(argv: list[str], prog: str) -> int:
    from engine.cli.main import main  # the CLI: imported only when a command line is run

    return main(argv, prog=prog)
