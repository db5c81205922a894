"""OpenAI request fields -> the engine's `SamplingParams` and `Request`s (and back for errors).

OpenAI's defaults where they differ from the engine's: temperature 1, and no length limit but
the context (`max_tokens` absent: the reply may run to the end of the model's context, as in
OpenAI's and vLLM's APIs). vLLM's `top_k: -1` means off, like the engine's 0.

Everything a request asks is checked here, before the engine sees it, against the served
model's `Bounds`: token ids in the vocabulary (prompts, reply prefixes, logit-bias keys), the
counts (prompts, n, best_of, stop strings and their length), seeds a generator can take. What
`SamplingParams` checks (ranges of the sampling knobs) it keeps checking, so the server and the
engine never disagree; its messages become 400s naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from engine.config import ConfigError, SamplingParams
from engine.request import ChatMessage, Request
from engine.serve.errors import ServeError
from engine.serve.logprobs import MAX_TOP_LOGPROBS
from engine.serve.protocol import ChatRequest, CompletionRequest, MessageIn, SamplingFields
from engine.serve.structured import check_together, grammar_of, tool_calls_of, tools_of
from engine.serve.tool_request import ToolRequest
from engine.text.chat_template import prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# SamplingParams' message prefixes -> the OpenAI parameter they are about.
_PARAM_OF_MESSAGE = (
    ("temperature", "temperature"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("max_new_tokens", "max_tokens"),
    ("snapshot_top_n", "kvscope.snapshot_top_n"),
    ("stop strings", "stop"),
    ("n ", "n"),
    ("n=", "n"),
    ("num_beams", "kvscope.num_beams"),
    ("beam search", "kvscope.num_beams"),
    ("choose either n", "n"),
    ("early_stopping", "kvscope.early_stopping"),
    ("length_penalty", "kvscope.length_penalty"),
    ("logit bias", "logit_bias"),
    ("a logit bias", "logit_bias"),
)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 1000  # one stop string's length (each is searched for in every new token's text)
MAX_PROMPTS = 64  # prompts in one completions request (each is an engine request)
SEED_RANGE = (-(2**63), 2**63 - 1024)  # what torch.Generator.manual_seed takes, less room for seed + i


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a request is checked against: the served model's vocabulary and context, and the
    engine's batch (read once when the server starts)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_prompts: int = MAX_PROMPTS


@dataclass(frozen=True, slots=True)
class Prompt:
    """One engine request's prompt, made into token ids off the engine thread
    (engine.serve.prompts: the chat template and the tokenizer run on a pool of their own)."""

    chat: Request | None = None  # rendered with the model's chat template
    text: str | None = None  # a completion prompt, tokenized as the tokenizer does by default
    ids: tuple[int, ...] = ()

    def token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if self.chat is not None:
            return prompt_ids(tokenizer, self.chat)
        if self.text is not None:
            return list(tokenizer(self.text)["input_ids"])
        return list(self.ids)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one HTTP request asks of the engine: one prompt per engine request (a completions
    request may carry several), the sampling they share, and how to answer."""

    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    top_logprobs: int | None  # None: no logprobs; else top-k per token (0 = only the chosen token)
    max_tokens_given: bool
    include_usage: bool
    tag: str | None
    # completions' `echo`: the prompt comes back before the reply; with `logprobs`, each of its
    # tokens with its log-probability (prompt log-probs, what loglikelihood evaluations read)
    echo: bool = False
    # `max_tokens: 0` with echo: the prompt alone, scored, and nothing generated
    score_only: bool = False
    tools: ToolRequest | None = None  # a chat request that offers tools

    @property
    def engine_text(self) -> bool:
        """The engine must make the text itself: beam search ranks finished texts, an attached
        app (a tagged request) reads its replies' text from the events stream, and a request
        with tools is read for calls by the engine at its end (the reading a grammar that holds
        calls was built for). Otherwise the server detokenizes, off
        the engine thread, and finds the stop strings itself (Reply): as vLLM's front end does,
        it cancels the engine's request once every choice has stopped."""
        return self.sampling.beam_search or self.tag is not None or self.tools is not None


def param_of(message: str) -> str | None:
    for prefix, param in _PARAM_OF_MESSAGE:
        if message.startswith(prefix):
            return param
    return None


def _refuse(param: str, message: str) -> ServeError:
    return ServeError(message, param=param, code="invalid_value")


def check_ids(ids: list[int] | tuple[int, ...], bounds: Bounds, param: str) -> None:
    vocab = bounds.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise _refuse(param, f"{param}: token id {bad} is not in the vocabulary (ids 0 to {vocab - 1})")


def _logit_bias(raw: dict[str, float] | None, bounds: Bounds) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map as the engine's pairs (SamplingParams checks the range)."""
    try:
        pairs = tuple((int(token), float(bias)) for token, bias in (raw or {}).items())
    except ValueError:
        keys = list(raw or {})[:5]
        raise _refuse("logit_bias", f"logit_bias keys must be token ids, got {keys}") from None
    check_ids([token for token, _ in pairs], bounds, "logit_bias")
    return pairs


def sampling_params(
    body: SamplingFields, max_tokens: int | None, bounds: Bounds, top_n: int
) -> SamplingParams:
    if body.n < 1:
        raise _refuse("n", f"n must be >= 1, got {body.n}")
    if body.n > bounds.max_num_seqs:
        raise _refuse(
            "n", f"n={body.n} asks for more sequences than the engine runs at once ({bounds.max_num_seqs})"
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP:
        raise _refuse("stop", f"at most {MAX_STOP} stop sequences, got {len(stop)}")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _refuse("stop", f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
    if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
        raise _refuse("seed", f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {body.seed}")
    if max_tokens is not None and max_tokens > bounds.max_model_len:
        raise ServeError(
            f"This model's context holds {bounds.max_model_len} tokens, but max_tokens is {max_tokens}: "
            "lower max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )
    top_k = body.top_k if body.top_k is not None else 0
    ext = body.kvscope
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=0 if top_k == -1 else top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed,
            max_new_tokens=bounds.max_model_len if max_tokens is None else max_tokens,
            stop=stop,
            ignore_eos=body.ignore_eos,
            snapshot_top_n=max(top_n, ext.snapshot_top_n if ext else 0),
            n=body.n,
            num_beams=ext.num_beams if ext else 1,
            length_penalty=ext.length_penalty if ext else 1.0,
            early_stopping=ext.early_stopping if ext else False,
            logit_bias=_logit_bias(body.logit_bias, bounds),
            grammar=grammar_of(body),
        )
    except ConfigError as exc:
        message = str(exc).replace("max_new_tokens", "max_tokens")
        raise ServeError(message, param=param_of(str(exc)), code="invalid_value") from exc


def chat_plan(body: ChatRequest, bounds: Bounds) -> Plan:
    tools = tools_of(body)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise _refuse("top_logprobs", "top_logprobs needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _refuse("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    top_logprobs = (top or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, bounds, _snapshot_size(top_logprobs))
    check_together(tools, params.grammar)
    messages = tuple(_message(i, m) for i, m in enumerate(body.messages))
    prefix = tuple(body.kvscope.reply_prefix_ids) if body.kvscope else ()
    check_ids(prefix, bounds, "kvscope.reply_prefix_ids")
    try:
        request = Request(
            messages=messages,
            sampling=params,
            reply_prefix_ids=prefix,
            tools=tools.tools if tools else (),
            tool_choice=tools.tool_choice if tools else "auto",
            tool_name=tools.tool_name if tools else "",
            parallel_tool_calls=tools.parallel_tool_calls if tools else True,
        )
    except ConfigError as exc:
        raise _refuse("messages", str(exc)) from exc
    return Plan(
        (Prompt(chat=request),),
        params,
        top_logprobs,
        max_tokens is not None,
        _usage(body),
        _tag(body),
        tools=tools if tools and tools.tool_choice != "none" else None,
    )


def completion_plan(body: CompletionRequest, bounds: Bounds) -> Plan:
    if body.suffix:
        raise _refuse("suffix", "suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise _refuse("best_of", f"best_of other than n is not supported by this server (got {body.best_of})")
    top = body.logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _refuse("logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise _refuse(
            "max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing generated)"
        )
    if score_only and body.stream:
        raise _refuse("stream", "max_tokens 0 (the prompt scored, nothing generated) has nothing to stream")
    params = sampling_params(body, 1 if score_only else body.max_tokens, bounds, _snapshot_size(top))
    if body.kvscope and body.kvscope.reply_prefix_ids:
        raise _refuse(
            "kvscope.reply_prefix_ids", "reply_prefix_ids continues a chat reply: use chat completions"
        )
    prompts = []
    given = _prompts(body.prompt)
    if len(given) > bounds.max_prompts:
        raise _refuse("prompt", f"at most {bounds.max_prompts} prompts in one request, got {len(given)}")
    for prompt in given:
        if isinstance(prompt, str):
            prompts.append(Prompt(text=prompt))
        elif not prompt or not all(isinstance(i, int) for i in prompt):
            raise _refuse("prompt", "a token prompt must be a non-empty list of token ids")
        else:
            check_ids(prompt, bounds, "prompt")
            prompts.append(Prompt(ids=tuple(prompt)))
    return Plan(
        tuple(prompts),
        params,
        top,
        body.max_tokens is not None,
        _usage(body),
        _tag(body),
        echo=body.echo,
        score_only=score_only,
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """str, [str, ...], [int, ...] or [[int, ...], ...] -> one entry per engine request."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _refuse("prompt", "the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [cast("list[int]", prompt)]
    return list(cast("list[str] | list[list[int]]", prompt))


def _message(index: int, message: MessageIn) -> ChatMessage:
    role = ROLE_ALIASES.get(message.role, message.role)
    if role not in ("system", "user", "assistant", "tool"):
        raise _refuse(
            f"messages.{index}.role",
            f"role {message.role!r} is not supported (system, user, assistant, tool)",
        )
    if message.tool_calls and role != "assistant":
        raise _refuse(f"messages.{index}.tool_calls", "only an assistant message carries tool calls")
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise _refuse(
                    f"messages.{index}.content",
                    f"content part of type {part.type!r} is not supported (text only)",
                )
            texts.append(part.text)
        content = "".join(texts)
    return ChatMessage(
        role,
        content or "",
        tool_calls=tool_calls_of(index, message.tool_calls),
        tool_call_id=message.tool_call_id or "",
        name=message.name or "",
    )


def _snapshot_size(top_logprobs: int | None) -> int:
    # A snapshot always carries the top 256 raw logits; one candidate is enough for them.
    return 0 if top_logprobs is None else max(1, top_logprobs)


def _usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _tag(body: SamplingFields) -> str | None:
    return body.kvscope.tag if body.kvscope else None
