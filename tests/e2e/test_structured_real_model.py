"""Structured output on the packaged SmolLM2-135M-Instruct at its own bits: for a set of schemas
(nested objects, arrays, enums, numbers with bounds, optional fields, $ref), every sample at
temperature 1.0 parses and validates; the same under n samples and beams; speculative decoding
under a schema gives plain decoding's tokens; and the tool-call grammar holds the model to a
valid call of the named tool."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.config import EngineConfig, GrammarSpec, ModelSpec, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished, ToolCallsParsed
from engine.request import ChatMessage, Request, ToolSpec

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "country": NAME},
                        "required": ["city", "country"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}},
        "required": ["fruits"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["small", "medium", "large"]},
        },
        "required": ["colour", "size"],
        "additionalProperties": False,
    },
    "numbers with bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "rooms": {"type": "integer", "exclusiveMinimum": 0, "maximum": 8},
        },
        "required": ["age", "score", "rooms"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "title": NAME,
            "subtitle": NAME,
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "$ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
}
SAMPLES = 4  # n=4 under each schema: four matchers forked at the prompt
MAX_NEW = 160


@pytest.fixture(scope="module")
def native():
    from engine.model.loading import load_model

    return load_model(ModelSpec("default", device="cpu"))


def run(engine: LLMEngine, request: Request) -> tuple[RequestFinished, list]:
    events: list = []
    engine.sink = events.append
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    (end,) = [e for e in events if isinstance(e, RequestFinished)]
    return end, events


@pytest.fixture(scope="module")
def engine(native):
    return LLMEngine(native, EngineConfig(block_size=16))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sample_at_temperature_one_validates(engine, name):
    schema = SCHEMAS[name]
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        n=SAMPLES,
        max_new_tokens=MAX_NEW,
        grammar=GrammarSpec("json_schema", json.dumps(schema)),
    )
    end, _ = run(engine, Request.chat(f"Give an example as JSON ({name}).", sampling=params))
    assert len(end.sequences) == SAMPLES
    for seq in end.sequences:
        assert seq.finish_reason == "stop", (name, seq.text)
        jsonschema.validate(json.loads(seq.text), schema)


def test_beams_under_a_schema_validate(engine):
    schema = SCHEMAS["enums"]
    params = SamplingParams(
        temperature=0.0,
        num_beams=3,
        max_new_tokens=MAX_NEW,
        grammar=GrammarSpec("json_schema", json.dumps(schema)),
    )
    end, _ = run(engine, Request.chat("Pick a colour and a size as JSON.", sampling=params))
    assert end.sequences
    for seq in end.sequences:
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(seq.text), schema)


def test_speculative_decoding_under_a_schema_equals_plain_decoding(native):
    schema = SCHEMAS["arrays"]
    request = Request.chat(
        'Repeat this JSON exactly: {"fruits": ["apple", "banana", "cherry"]}',
        sampling=SamplingParams(
            temperature=0.0, max_new_tokens=MAX_NEW, grammar=GrammarSpec("json_schema", json.dumps(schema))
        ),
    )
    plain, _ = run(LLMEngine(native, EngineConfig(block_size=16)), request)
    # rounds whatever the tuner would make of their cost under a grammar (its masks grow with rows)
    speculative = SpeculativeConfig("ngram", num_draft=4, adaptive=False)
    spec, _ = run(LLMEngine(native, EngineConfig(block_size=16, speculative=speculative)), request)
    assert spec.token_ids == plain.token_ids and spec.stats.spec_accepted > 0
    jsonschema.validate(json.loads(plain.text), schema)


def test_a_named_tool_call_is_a_valid_call(engine):
    weather = ToolSpec(
        "get_weather",
        "The current weather in a city",
        json.dumps(
            {
                "type": "object",
                "properties": {"city": NAME},
                "required": ["city"],
                "additionalProperties": False,
            }
        ),
    )
    request = Request(
        messages=(ChatMessage("user", "What is the weather in Paris?"),),
        tools=(weather,),
        tool_choice="named",
        tool_name="get_weather",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
    )
    end, events = run(engine, request)
    (parsed,) = [e for e in events if isinstance(e, ToolCallsParsed)]
    assert end.finish_reason == "stop" and not parsed.error
    (call,) = parsed.calls
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
