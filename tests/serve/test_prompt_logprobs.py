"""Prompt log-probs on /v1/completions: `echo` with `logprobs` returns every prompt token with its
log-probability under the tokens before it (null for the first), the top candidates there, then
the generated tokens', in OpenAI's shape, so lm-evaluation-harness's `local-completions`
loglikelihood requests (token-id prompts, `max_tokens: 1`, `logprobs: 1`, `echo: true`) read the
same numbers as transformers' log-softmax of the prompt's logits; `max_tokens: 0` scores the prompt
alone; a prompt past the context is refused with its count."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_helpers import MODEL, pool_used

from engine.serve.schema import Completion


@pytest.fixture(scope="module")
def reference_model(default_tokenizer):
    from tiny_models import make_tiny_llama

    return make_tiny_llama(vocab_size=len(default_tokenizer))


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def post(server, **body):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    return response


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness 0.4's LocalCompletionsAPI.parse_logprobs, for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))
    return sum(token_logprobs), greedy


def test_echo_with_logprobs_scores_every_prompt_token_as_transformers_does(
    server, reference_model, default_tokenizer
):
    context = default_tokenizer("The capital of France is")["input_ids"]
    continuation = default_tokenizer(" Paris, a city")["input_ids"]
    ids = context + continuation
    # what lm-eval sends for a batch of two loglikelihood requests
    response = post(
        server, prompt=[ids, context], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    assert response.status_code == 200, response.text
    body = response.json()
    first, second = sorted(body["choices"], key=lambda c: c["index"])
    want = log_softmax(reference_model, ids)
    lp = first["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    Completion.model_validate(body)  # the nulls are in the schema the server publishes
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-5)
        ((top_text, top_lp),) = lp["top_logprobs"][p].items()
        best = int(want[p - 1].argmax())
        assert top_lp == pytest.approx(float(want[p - 1, best]), abs=1e-5)
        assert top_text == default_tokenizer.decode([best])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    total, greedy = lm_eval_parse(first, len(context))
    assert total == pytest.approx(
        float(sum(want[p - 1, ids[p]] for p in range(len(context), len(ids)))), abs=1e-4
    )
    argmax = [int(want[p - 1].argmax()) for p in range(len(context), len(ids))]
    assert greedy == (argmax == ids[len(context) :])
    assert first["text"].startswith(default_tokenizer.decode(ids))
    assert len(second["logprobs"]["tokens"]) == len(context) + 1
    assert body["usage"]["prompt_tokens"] == len(ids) + len(context)
    assert pool_used(server) == 0


def test_a_greedy_continuation_reads_as_greedy(server, default_tokenizer):
    context = default_tokenizer("One two three")["input_ids"]
    generated = post(server, prompt=context, max_tokens=3, temperature=0).json()
    continuation = default_tokenizer(generated["choices"][0]["text"], add_special_tokens=False)["input_ids"]
    ids = context + continuation
    choice = post(server, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True).json()["choices"][0]
    total, greedy = lm_eval_parse(choice, len(context))
    # the model's own greedy tokens: each is its top candidate, its logprob the top one's to the bit
    if default_tokenizer.decode(ids) == default_tokenizer.decode(context) + generated["choices"][0]["text"]:
        assert greedy


def test_max_tokens_0_scores_the_prompt_alone(server, reference_model, default_tokenizer):
    ids = default_tokenizer("Water boils at one hundred degrees")["input_ids"]
    body = post(
        server, prompt="Water boils at one hundred degrees", max_tokens=0, logprobs=2, echo=True
    ).json()
    (choice,) = body["choices"]
    assert choice["text"] == "Water boils at one hundred degrees"
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    want = log_softmax(reference_model, ids)
    assert lp["token_logprobs"][-1] == pytest.approx(float(want[-2, ids[-1]]), abs=1e-5)
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_streamed_echo_carries_the_prompts_logprobs_first(server, default_tokenizer):
    ids = default_tokenizer("Roses are red")["input_ids"]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 2,
            "logprobs": 1,
            "echo": True,
            "stream": True,
            "temperature": 0,
        },
        timeout=60,
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    import json

    first = json.loads(lines[0][6:])
    assert first["choices"][0]["text"] == default_tokenizer.decode(ids)
    assert len(first["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert lines[-1] == "data: [DONE]"


def test_a_prompt_past_the_context_is_refused_with_its_count(server):
    limit = server.bridge.max_model_len
    response = post(server, prompt=[5] * (limit + 3), max_tokens=0, logprobs=1, echo=True)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(limit + 3) in error["message"]
