"""Every refusal in OpenAI's error shape, through the official client and raw HTTP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import MODEL, chat

from engine.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def assert_openai_shape(body: dict, param=None, code=None) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"n": 20, "temperature": 1}, "n"),  # more sequences than the engine batches
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"42": 500}}, "logit_bias"),  # OpenAI's range is [-100, 100]
        ({"logit_bias": {"forty-two": 5}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ({"temperature": "hot"}, "temperature"),
        ({"kvscope": {"snapshot_top_n": 1000}}, "kvscope.snapshot_top_n"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_parameter(server, fields, param):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert assert_openai_shape(response.json(), param=param)["type"] == "invalid_request_error"


def test_bad_completion_parameters_and_bodies(server):
    for fields, param in (
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # nothing to generate, and no echo to score
        ({"max_tokens": 0, "echo": True, "stream": True}, "stream"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
    ):
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, **fields}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (fields, response.text)
        assert_openai_shape(response.json(), param=param)
    broken = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert broken.status_code == 400
    assert_openai_shape(broken.json())


def test_the_client_raises_bad_request_for_streams_too(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=chat("hi"), temperature=-2, stream=True)
    assert "temperature must be >= 0" in err.value.message
    assert err.value.body["param"] == "temperature"


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=chat("hi"))
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.message
    response = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert_openai_shape(response.json(), param="model", code="model_not_found")
    unknown_route = httpx.get(server.url + "/v1/nothing-here")
    assert unknown_route.status_code == 404
    assert_openai_shape(unknown_route.json())


def test_a_request_past_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=5000)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    assert "2048" in err.value.message


@pytest.fixture(scope="module")
def small_pool_server(tiny_loaded):
    from engine.serve.server import BackgroundServer

    with BackgroundServer(EngineConfig(block_size=4, num_blocks=12), loaded=tiny_loaded) as srv:
        yield srv


def test_a_request_the_kv_pool_can_never_hold_is_a_clear_400(small_pool_server):
    with openai.OpenAI(base_url=small_pool_server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=chat("a long message " * 10), max_tokens=1)
        assert err.value.code == "kv_cache_too_small" and err.value.param == "max_tokens"
        assert "12 blocks of 4 tokens" in err.value.message and "can never hold" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=chat("a long message " * 10))
        assert err.value.code == "kv_cache_too_small" and err.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=chat("hi"), max_tokens=40, n=2, temperature=1
            )
        assert "for each of 2 sequences" in err.value.message
        # what fits still runs
        ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3


@pytest.fixture(scope="module")
def keyed_server(tiny_loaded):
    from engine.serve.server import BackgroundServer

    with BackgroundServer(
        EngineConfig(block_size=4, num_blocks=64), loaded=tiny_loaded, api_key="s3cret"
    ) as srv:
        yield srv


def test_an_api_key_guards_every_route_but_a_plain_health(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = httpx.get(url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert_openai_shape(response.json(), code="invalid_api_key")
    with (
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=1)
    with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as client:
        assert client.models.list().data[0].id == MODEL
        assert client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=1).choices
    # the metrics say what runs and how busy it is, the events stream carries every client's
    # tokens, the schema lists the routes: all need the key
    for path in ("/metrics", "/v1/kvscope/events", "/openapi.json"):
        refused = httpx.get(url + path)
        assert refused.status_code == 401, path
        assert_openai_shape(refused.json(), code="invalid_api_key")
    assert httpx.post(url + "/health").status_code == 401, "only a plain GET /health is open"
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}, "no model named"
    key = {"Authorization": "Bearer s3cret"}
    assert httpx.get(url + "/metrics", headers=key).status_code == 200
    assert httpx.get(url + "/openapi.json", headers=key).json()["openapi"]


def test_non_loopback_bind_needs_an_api_key():
    from engine.serve.server import check_bind, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.com")
    with pytest.raises(ConfigError, match="refusing to listen on 0.0.0.0 without --api-key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "key")
    check_bind("127.0.0.1", None)
    with pytest.raises(ConfigError, match="must not be empty"):
        check_bind("127.0.0.1", " ")


def test_the_cli_refuses_a_public_bind_without_a_key_before_loading(monkeypatch):
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVSCOPE_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: refusing to listen on 0.0.0.0 without --api-key: anyone who can reach it could use the engine. "
        "Give --api-key KEY (clients then send 'Authorization: Bearer KEY'), or bind 127.0.0.1."
    ]


def test_kvscope_serve_is_the_same_command():
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVSCOPE_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--host", "10.1.2.3", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2 and "refusing to listen on 10.1.2.3 without --api-key" in result.stderr
    assert "Traceback" not in result.stderr


def test_cors_is_off_by_default(server):
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_cors_allows_only_the_origins_named(tiny_loaded):
    from engine.serve.server import BackgroundServer

    with BackgroundServer(
        EngineConfig(block_size=4, num_blocks=64),
        loaded=tiny_loaded,
        api_key="k",
        cors_origins=("https://app.example",),
    ) as srv:
        ok = httpx.options(
            srv.url + "/v1/chat/completions",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"},
        )  # fmt: skip
        assert ok.status_code == 200, "a preflight carries no key: CORS answers it before the key check"
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            srv.url + "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
