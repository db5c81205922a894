"""The official `openai` client against `kvscope serve`: streaming, logprobs, n, stop, seed and the
prefix cache, on the tiny random model (a real uvicorn on a loopback port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from serve_helpers import MODEL, chat

ROOT = Path(__file__).resolve().parents[2]


def streamed(client, model: str = MODEL, **kwargs) -> tuple[dict[int, str], list]:
    """Every chunk of a streamed chat completion, and the text of each choice."""
    texts: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=model, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


# ---- streaming equals the CLI ----------------------------------------------------------------
@pytest.fixture(scope="module")
def folder_server(tmp_path_factory, default_tokenizer):
    """The tiny model saved as a folder, served by a server that loads it as `engine generate` does."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from model_folders import save_tiny_model

    from engine.config import EngineConfig, ModelSpec
    from engine.serve.server import BackgroundServer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", default_tokenizer)
    with BackgroundServer(EngineConfig(model=ModelSpec(str(folder), device="cpu")), model_name="tiny") as srv:
        yield srv, folder


def test_streamed_greedy_text_equals_engine_generate(folder_server):
    import openai

    server, folder = folder_server
    prompt = "Tell me about the sea."
    cli = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--device", "cpu", "--prompt", prompt,
         "--temperature", "0", "--max-new-tokens", "24", "--ignore-eos", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    expected = json.loads(cli.stdout)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        texts, chunks = streamed(
            client, "tiny", messages=chat(prompt), temperature=0, max_tokens=24,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert texts == {0: expected["text"]} and expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == expected["finish_reason"] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == expected["prompt_tokens"]
    assert all(c.usage is None for c in chunks[:-1])  # null until the usage chunk, as OpenAI streams


def test_non_streaming_matches_streaming_with_usage_and_timings(client):
    args = dict(
        messages=chat("Name three rivers."), temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    texts, _ = streamed(client, **args)
    whole = client.chat.completions.create(model=MODEL, **args)
    assert whole.object == "chat.completion" and whole.choices[0].message.content == texts[0]
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    timings = whole.model_extra["timings"]
    assert (
        timings["predicted_n"] == 12 and timings["prompt_n"] + timings["cache_n"] == whole.usage.prompt_tokens
    )
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0


def test_logit_bias_forces_and_bans_tokens(client, default_tokenizer):
    args = dict(messages=chat("Name three rivers."), temperature=0, max_tokens=4, logprobs=True)
    args["extra_body"] = {"ignore_eos": True}

    def tokens(**bias) -> list[str]:
        reply = client.chat.completions.create(model=MODEL, **args, **bias)
        return [entry.token for entry in reply.choices[0].logprobs.content]

    assert tokens(logit_bias={"42": 100}) == [default_tokenizer.decode([42])] * 4  # +100 forces it
    first = tokens()[0]
    (first_id,) = default_tokenizer.encode(first, add_special_tokens=False)
    assert tokens(logit_bias={str(first_id): -100})[0] != first  # -100 bans greedy's own first token


# ---- logprobs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_model(default_tokenizer):
    """The same tiny weights as the server's (same seed), an instance of its own for plain forwards."""
    from tiny_models import make_tiny_llama

    return make_tiny_llama(vocab_size=len(default_tokenizer))


def raw_log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("k", [5, 20])
def test_logprobs_are_the_raw_distribution_top_k(client, reference_model, default_tokenizer, k):
    messages = chat("What is the capital of France?")
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=k,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    text = default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = default_tokenizer(text, add_special_tokens=False)["input_ids"]
    for entry in content:
        expected = raw_log_softmax(reference_model, ids)
        values, top_ids = torch.topk(expected, k)
        assert len(entry.top_logprobs) == k
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [bytes(t.bytes).decode("utf-8", "replace") for t in entry.top_logprobs] == [
            default_tokenizer.decode([i]) for i in top_ids.tolist()
        ]
        # greedy: the chosen token is the likeliest one, and its logprob is the raw one (not 0)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert entry.logprob < 0 and bytes(entry.bytes).decode() == entry.token
        ids.append(int(top_ids[0]))
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_streamed_logprobs_equal_the_whole_response(client):
    args = dict(messages=chat("Count to three."), temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(model=MODEL, **args).choices[0].logprobs.content
    _, chunks = streamed(client, **args)
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    # The second request reuses the first one's prompt blocks (prefix cache): its prefill is a
    # shorter computation, equal to float rounding.
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in entries] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in whole
    ]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole], abs=1e-5)


def test_sampled_token_logprob_is_under_the_raw_distribution(client, reference_model, default_tokenizer):
    from engine.serve.logprobs import token_bytes_table

    id_of = {b: i for i, b in enumerate(token_bytes_table(default_tokenizer))}
    messages = chat("Say anything.")
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.5, seed=3, max_tokens=6, logprobs=True, top_logprobs=0,
        extra_body={"top_k": 50, "ignore_eos": True},
    )  # fmt: skip
    text = default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = default_tokenizer(text, add_special_tokens=False)["input_ids"]
    for entry in reply.choices[0].logprobs.content:
        assert entry.top_logprobs == []
        token_id = id_of[bytes(entry.bytes)]
        # not the sampling distribution's (temperature 1.5, top-k 50): the model's own
        assert entry.logprob == pytest.approx(
            float(raw_log_softmax(reference_model, ids)[token_id]), abs=1e-4
        )
        ids.append(token_id)


def test_completions_logprobs_and_echo(client):
    reply = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text and lp.text_offset[0] == 0
    assert all(
        len(t) <= 3 and max(t.values()) == pytest.approx(v)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs)
    )
    echoed = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Once upon a time" + reply.choices[0].text


def test_completions_with_several_prompts_and_token_prompts(client, default_tokenizer):
    ids = default_tokenizer("The sky is")["input_ids"]
    reply = client.completions.create(
        model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text
    assert reply.usage.completion_tokens == 8


# ---- n, stop, seed ---------------------------------------------------------------------------
def test_n_samples_are_choices_and_a_seed_reproduces_them(client):
    args = dict(
        messages=chat("Invent a word."),
        temperature=1.0,
        n=3,
        max_tokens=8,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    first = client.chat.completions.create(model=MODEL, **args)
    again = client.chat.completions.create(model=MODEL, **args)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.message.content for c in again.choices] == texts
    other = client.chat.completions.create(model=MODEL, **{**args, "seed": 12})
    assert [c.message.content for c in other.choices] != texts
    streamed_texts, _ = streamed(client, **args)
    assert [streamed_texts[i] for i in range(3)] == texts
    assert first.usage.completion_tokens == 3 * 8 and {c.finish_reason for c in first.choices} == {"length"}


def test_stop_string_ends_the_reply_before_it(client):
    args = dict(
        messages=chat("Write a sentence."),
        temperature=1.0,
        seed=5,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(model=MODEL, **args).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {full!r}"
    cut = client.chat.completions.create(model=MODEL, stop=[stop], **args).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]
    texts, chunks = streamed(client, stop=stop, **args)
    assert texts[0] == cut.message.content and chunks[-1].choices[0].finish_reason == "stop"
    # The server found the stop string and cancelled the engine's request: the tokens the engine
    # made past it are in neither the reply nor its usage.
    scored = client.chat.completions.create(model=MODEL, stop=[stop], logprobs=True, **args)
    tokens = scored.choices[0].logprobs.content
    assert scored.usage.completion_tokens == len(tokens) < args["max_tokens"]
    assert stop in "".join(t.token for t in tokens)[len(cut.message.content) :]


def test_each_sample_stops_at_its_own_stop_string(client):
    args = dict(
        messages=chat("Write a sentence."),
        temperature=1.0,
        seed=9,
        n=2,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    full = [c.message.content for c in client.chat.completions.create(model=MODEL, **args).choices]
    stop = full[0][len(full[0]) // 2 : len(full[0]) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL, stop=[stop], **args).choices
    for choice, text in zip(cut, full, strict=True):
        if stop in text:
            assert choice.finish_reason == "stop" and choice.message.content == text[: text.index(stop)]
        else:  # the other sample never met it: it runs to its length
            assert choice.finish_reason == "length" and choice.message.content == text


# ---- the prefix cache ------------------------------------------------------------------------
def test_cached_tokens_on_a_repeated_long_system_prompt(client):
    system = " ".join(
        f"Guideline {i}: be precise about item {i} and mention nothing else." for i in range(40)
    )
    first = client.chat.completions.create(
        model=MODEL, messages=chat("First question?", system), max_tokens=2
    )
    second = client.chat.completions.create(model=MODEL, messages=chat("Another one!", system), max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 300 and cached % 4 == 0 and cached < second.usage.prompt_tokens
    assert second.model_extra["timings"]["cache_n"] == cached


def test_a_stop_string_the_server_finds_cancels_the_request_once(default_tokenizer):
    """The reply (server side) finds the stop string, cancels the engine request once, and
    leaves out of the text and the usage the tokens the engine made after it."""
    from engine.config import SamplingParams
    from engine.events import RequestFinished, RequestStarted, RequestStats, TokenGenerated
    from engine.serve.bridge import Started
    from engine.serve.logprobs import TokenStrings
    from engine.serve.params import Plan, Prompt
    from engine.serve.replies import Reply

    ids = default_tokenizer.encode("The cat sat. Then the dog ran far away")
    text = default_tokenizer.decode(ids)
    kept = next(i + 1 for i in range(len(ids)) if "." in default_tokenizer.decode(ids[: i + 1]))
    plan = Plan((Prompt(),), SamplingParams(max_new_tokens=32, stop=(".",)), None, True, False, None)
    cancelled: list[int] = []
    for stream in (True, False):
        reply = Reply(
            "completion",
            plan,
            [Started(7, 3)],
            TokenStrings([]),
            MODEL,
            tokenizer=default_tokenizer,
            cancel=cancelled.append,
        )
        made = [TokenGenerated(7, i, t, "", "", -1.0) for i, t in enumerate(ids)]
        stats = RequestStats(3, len(ids), 0, 0.1, (0.01,) * (len(ids) - 1), 1.0, 0, 1)
        chunks = reply.fold(
            [RequestStarted(7, 3), *made, RequestFinished(7, "cancelled", "", tuple(ids), stats)]
        )
        assert reply.done and reply.error is None
        if stream:
            assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(".")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            body = reply.body()
            assert body["choices"][0]["text"] == text[: text.index(".")]
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == kept
    assert cancelled == [7, 7]  # once per reply
