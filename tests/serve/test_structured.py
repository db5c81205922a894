"""Structured output and tools through the official `openai` client against `kvscope serve` (the
tiny random model with the real SmolLM2 tokenizer): response_format with a schema, vLLM's guided_*
names, tools with tool_choice auto/required/named, streamed and whole, calls and results sent
back, and the bad inputs each answered with a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serve_helpers import MODEL, chat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_response_format_json_schema_whole_and_streamed(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=chat("Describe someone"), response_format=SCHEMA_FORMAT, max_tokens=80, seed=3
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=chat("Describe someone"),
            response_format=SCHEMA_FORMAT,
            max_tokens=80,
            seed=3,
            stream=True,
        )
        if c.choices
    )
    assert text == choice.message.content


def test_json_object_and_vllm_guided_names(client):
    obj = client.chat.completions.create(
        model=MODEL,
        messages=chat("JSON please"),
        response_format={"type": "json_object"},
        max_tokens=60,
        seed=1,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    regex = client.chat.completions.create(
        model=MODEL, messages=chat("A year"), max_tokens=20, extra_body={"guided_regex": "(19|20)[0-9]{2}"}
    )
    text = regex.choices[0].message.content
    assert len(text) == 4 and text[:2] in ("19", "20") and text.isdigit()
    pick = client.chat.completions.create(
        model=MODEL,
        messages=chat("Colour?"),
        max_tokens=20,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert pick.choices[0].message.content in ("red", "green", "blue")
    guided = client.completions.create(
        model=MODEL, prompt="Person: ", max_tokens=80, extra_body={"guided_json": PERSON}, seed=2
    )
    jsonschema.validate(json.loads(guided.choices[0].text), PERSON)


def test_tool_choice_required_whole(client):
    out = client.chat.completions.create(
        model=MODEL, messages=chat("Weather in Paris?"), tools=[WEATHER, ADD], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, seed=5,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (
        call.type == "function"
        and call.id.startswith("call_")
        and call.function.name in ("get_weather", "add")
    )
    schema = (WEATHER if call.function.name == "get_weather" else ADD)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert choice.message.content is None


def _streamed_calls(chunks) -> tuple[dict[int, dict], str, str | None, int]:
    calls: dict[int, dict] = {}
    content, finish, deltas = "", None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                deltas += 1
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
    return calls, content, finish, deltas


def test_tool_choice_named_streams_its_arguments_as_they_are_written(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=chat("Add 2 and 3"), tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120, seed=1, stream=True,
        )
    )  # fmt: skip
    calls, content, finish, deltas = _streamed_calls(chunks)
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "add" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])
    assert deltas > 3  # the id and name first, then the arguments in pieces


def test_tool_choice_auto_answers_in_words_or_calls(client):
    out = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), tools=[WEATHER], tool_choice="auto", max_tokens=16, seed=2
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason != "tool_calls":
        assert choice.message.tool_calls is None and choice.message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=chat("Hi"), tools=[WEATHER], max_tokens=16, seed=2, stream=True
        )
    )
    calls, content, finish, _ = _streamed_calls(chunks)
    assert content == (choice.message.content or "") and finish == choice.finish_reason


def test_the_calls_and_their_results_go_back_in_the_next_turn(client):
    first = client.chat.completions.create(
        model=MODEL, messages=chat("Weather in Oslo?"), tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, seed=3,
    )  # fmt: skip
    message = first.choices[0].message
    call = message.tool_calls[0]
    follow = [
        *chat("Weather in Oslo?"),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 7}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=follow, tools=[WEATHER], max_tokens=8, seed=3
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format.json_schema.schema",
            "is invalid",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}},
                }
            },
            "response_format.json_schema.schema",
            "cannot be compiled",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "needs its schema",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "cannot be compiled"),
        ({"guided_grammar": 'start: "a" b'}, "guided_grammar", "unknown name"),
        ({"guided_regex": "a", "guided_choice": ["x"]}, "guided_choice", "not several"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "offers no tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
            "tools.0.function.parameters",
            "is invalid",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot also follow",
        ),
        ({"tools": [WEATHER], "guided_regex": "[0-9]+"}, "tools", "combine only with a JSON response format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(server, extra, param, words):
    body = {"model": MODEL, "messages": chat("x"), "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and "Traceback" not in r.text


def test_the_served_schema_documents_tools_and_response_formats(server):
    """/openapi.json (what `./dev fuzz` holds the server to) says what is taken, not that it is refused."""
    schema = httpx.get(server.url + "/openapi.json", timeout=60).json()
    components = schema["components"]["schemas"]
    request = components["ChatRequest"]["properties"]
    for field in ("tools", "tool_choice", "response_format", "parallel_tool_calls", "guided_json"):
        assert field in request, field
    assert "maxItems" not in json.dumps(request["tools"])
    kinds = components["ResponseFormat"]["properties"]["type"]["enum"]
    assert set(kinds) == {"text", "json_object", "json_schema"}
    assert "tool" in components["MessageIn"]["properties"]["role"]["enum"]


def test_a_grammar_with_no_next_token_stops_with_its_reason(server):
    body = {"model": MODEL, "messages": chat("x"), "max_tokens": 10, "guided_grammar": 'start: "ab" /[b&&c]/'}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "ab"
    assert "permits no next token" in choice["stop_reason"]


def test_a_malformed_call_comes_back_as_content_with_its_error():
    """auto: the model wrote something that starts a call but does not parse. The server's reply,
    folded from the engine's events: the text comes back whole as content, with the error, and
    no call; streamed, nothing of it went out as a call."""
    from engine.config import SamplingParams
    from engine.events import RequestFinished, RequestStarted, RequestStats, TokenGenerated, ToolCallsParsed
    from engine.serve.bridge import Started
    from engine.serve.logprobs import TokenStrings
    from engine.serve.params import Plan, Prompt
    from engine.serve.replies import Reply
    from engine.serve.tool_request import ToolRequest
    from engine.tools.formats import Hermes

    pieces = [
        "Let me check.",
        "<tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Par',
        "\n</tool_call>",
    ]
    text = "".join(pieces)
    parsed = Hermes().parse(text[len("Let me check.") :])
    assert parsed.error  # the JSON is cut
    plan = Plan((Prompt(),), SamplingParams(), None, False, False, None, tools=ToolRequest((), "auto"))
    stats = RequestStats(3, len(pieces), 0, 0.1, (), 1.0, 0, 1)
    events = [RequestStarted(1, 3)]
    events += [TokenGenerated(1, i, 100 + i, p, p, -1.0) for i, p in enumerate(pieces)]
    events += [
        ToolCallsParsed(1, "hermes", "Let me check.", (), text[13:], 3, 5, parsed.error),
        RequestFinished(1, "stop", text, tuple(range(5)), stats),
    ]
    for stream in (True, False):
        reply = Reply("chat", plan, [Started(1, 3)], TokenStrings([]), MODEL, tool_format=Hermes())
        chunks = reply.fold(events)
        if stream:
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert content == text and not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert chunks[-1]["choices"][0]["tool_call_error"] == parsed.error
        else:
            (choice,) = reply.body()["choices"]
            assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
            assert choice["finish_reason"] == "stop" and choice["tool_call_error"].startswith(
                "call 1 is not valid JSON"
            )
