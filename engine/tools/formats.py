"""The tool-call formats model families are trained on, each able to read calls out of a reply
and to write the grammar a required call must follow.

  hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
               (Hermes 2/3, Qwen 2.5/3, and kvscope's own prompt for templates without tools)
  llama3_json  {"name": ..., "parameters": {...}} as the whole reply, calls joined by "; ", after
               an optional <|python_tag|> (Llama 3.1-3.3's JSON tool calling)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 tokenizers), or
               [TOOL_CALLS]name[ARGS]{...} per call (v11 and later)

A reply that is not a call is content. One that starts a call but does not parse is an error
with its text kept (`ParsedReply.error`, `raw`): nothing is called from it, nothing is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.events import ToolCall
from engine.request import ToolSpec

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
# How a call's arguments are laid out when a grammar writes them: as json.dumps does.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str  # the text outside the calls
    calls: tuple[ToolCall, ...] = ()
    raw: str = ""  # the calls' text as written
    start: int = 0  # where it is in the reply's text: text[start:end]
    end: int = 0
    error: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text of an object (a model may write them as a JSON string)."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"the arguments are {type(value).__name__}, not an object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, tools: Sequence[ToolSpec], arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('a call is an object with a "name"')
    name = obj["name"]
    if tools and name not in {t.name for t in tools}:
        raise ValueError(f"there is no tool named {name!r}")
    keys = (arguments_key, "arguments", "parameters")
    raw_args: Any = next((obj[k] for k in keys if k in obj), {})
    try:
        arguments = _arguments(raw_args)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"the arguments of {name!r} are not a JSON object ({exc})") from None
    return ToolCall(name, arguments, new_call_id())


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"not valid JSON ({exc.msg} at character {exc.pos})"


def _call_schema(tool: ToolSpec, arguments_key: str) -> dict[str, Any]:
    """One call of `tool` as a JSON Schema: its name fixed, its arguments the tool's schema."""
    try:
        parameters = json.loads(tool.parameters)
    except json.JSONDecodeError:
        parameters = {"type": "object"}
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object"}
    return {
        "x-guidance": JSON_LAYOUT,
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _one_call_rule(tools: Sequence[ToolSpec], arguments_key: str) -> str:
    """Lark: `call_body` is one call of any of `tools`, each through its own JSON Schema."""
    names = [f"tool{i}" for i in range(len(tools))]
    rules = [f"call_body: {' | '.join(names)}"]
    rules += [f"{n}: %json {json.dumps(_call_schema(t, arguments_key))}" for n, t in zip(names, tools)]
    return "\n".join(rules)


def _alternative(rule: str, schema: dict[str, Any] | None) -> str:
    """A start rule that is the calls, or (tool_choice auto under a JSON response format) a
    reply in that schema."""
    if schema is None:
        return f"start: {rule}"
    return f"start: {rule} | answer\nanswer: %json {json.dumps({'x-guidance': JSON_LAYOUT, **schema})}"


class ToolFormat:
    name = ""
    # Text that begins the calls in a streamed reply (the server holds back what could be it).
    start_marker = ""
    # Special tokens of the format, which the reply's plain text leaves out (the detokenizer
    # skips special tokens): a streamed reply puts them back to find the calls.
    markers: tuple[str, ...] = ()
    arguments_key = "arguments"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> ParsedReply:
        raise NotImplementedError

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict[str, Any] | None = None
    ) -> str:
        """Lark for a reply that is one call (or, `parallel`, several) of `tools`."""
        raise NotImplementedError

    def write_call(self, call: ToolCall) -> str:
        """A call as this format writes it (an assistant turn rendered without the template's help)."""
        raise NotImplementedError


class Hermes(ToolFormat):
    name = HERMES
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> ParsedReply:
        blocks = list(self._block.finditer(text))
        if not blocks:
            return ParsedReply(text.strip())
        start, end = blocks[0].start(), blocks[-1].end()
        content = (text[:start] + text[end:]).strip()
        raw = text[start:end]
        calls = []
        for i, block in enumerate(blocks):
            if not block.group(0).endswith("</tool_call>"):
                return ParsedReply(content, (), raw, start, end, f"call {i + 1} has no closing </tool_call>")
            try:
                calls.append(_call(json.loads(block.group(1).strip()), tools, self.arguments_key))
            except json.JSONDecodeError as exc:
                return ParsedReply(content, (), raw, start, end, f"call {i + 1} is {_json_error(exc)}")
            except ValueError as exc:
                return ParsedReply(content, (), raw, start, end, f"call {i + 1}: {exc}")
        return ParsedReply(content, tuple(calls), raw, start, end)

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict[str, Any] | None = None
    ) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return "\n".join(
            [
                _alternative(calls, answer_schema),
                'call: "<tool_call>\\n" call_body "\\n</tool_call>"',
                _one_call_rule(tools, self.arguments_key),
            ]
        )

    def write_call(self, call: ToolCall) -> str:
        body = json.dumps(
            {"name": call.name, "arguments": json.loads(call.arguments or "{}")}, ensure_ascii=False
        )
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3Json(ToolFormat):
    name = LLAMA3_JSON
    start_marker = "{"
    markers = ("<|python_tag|>",)
    arguments_key = "parameters"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> ParsedReply:
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith("<|python_tag|>"):
            lead += len("<|python_tag|>")
            body = body[len("<|python_tag|>") :]
            lead += len(body) - len(body.lstrip())
            body = body.lstrip()
        if not re.match(r'\{\s*"name"\s*:', body):
            return ParsedReply(text.strip())  # a reply in words (or JSON that is no call)
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
                calls.append(_call(obj, tools, self.arguments_key))
            except json.JSONDecodeError as exc:
                return ParsedReply(
                    "", (), text[lead:], lead, len(text), f"call {len(calls) + 1} is {_json_error(exc)}"
                )
            except ValueError as exc:
                return ParsedReply("", (), text[lead:], lead, len(text), f"call {len(calls) + 1}: {exc}")
            rest = body[at:].lstrip()
            if not rest.startswith(";"):
                break
            at = len(body) - len(rest) + 1
            while at < len(body) and body[at].isspace():
                at += 1
        end = lead + at
        return ParsedReply(text[end:].strip(), tuple(calls), text[lead:end], lead, end)

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict[str, Any] | None = None
    ) -> str:
        calls = 'call_body ("; " call_body)*' if parallel else "call_body"
        return "\n".join([_alternative(calls, answer_schema), _one_call_rule(tools, self.arguments_key)])

    def write_call(self, call: ToolCall) -> str:
        return json.dumps(
            {"name": call.name, "parameters": json.loads(call.arguments or "{}")}, ensure_ascii=False
        )


class Mistral(ToolFormat):
    name = MISTRAL
    start_marker = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]", "[ARGS]")

    def __init__(self, marker_token_id: int | None = None):
        # A tokenizer whose [TOOL_CALLS] is a special token: the grammar names it by id.
        self.marker_token_id = marker_token_id

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> ParsedReply:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return ParsedReply(text.strip())
        content = text[:start].strip()
        raw = text[start:]
        body = raw[len("[TOOL_CALLS]") :].strip()
        try:
            if body.startswith("["):  # v3: one JSON array of calls
                obj, at = json.JSONDecoder().raw_decode(body)
                if not isinstance(obj, list):
                    raise ValueError("the calls are not a JSON array")
                calls = tuple(_call(o, tools, self.arguments_key) for o in obj)
            else:  # v11+: name[ARGS]{...}, each after its own [TOOL_CALLS]
                calls = tuple(self._named_calls(raw, tools))
        except json.JSONDecodeError as exc:
            return ParsedReply(content, (), raw, start, len(text), f"the calls are {_json_error(exc)}")
        except ValueError as exc:
            return ParsedReply(content, (), raw, start, len(text), str(exc))
        return ParsedReply(content, calls, raw, start, len(text))

    def _named_calls(self, raw: str, tools: Sequence[ToolSpec]) -> list[ToolCall]:
        calls = []
        for part in [p for p in raw.split("[TOOL_CALLS]") if p.strip()]:
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                raise ValueError("a call has no [ARGS]")
            obj, _ = json.JSONDecoder().raw_decode(args.strip())
            calls.append(_call({"name": name.strip(), "arguments": obj}, tools, self.arguments_key))
        return calls

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict[str, Any] | None = None
    ) -> str:
        marker = f"<[{self.marker_token_id}]>" if self.marker_token_id is not None else '"[TOOL_CALLS]"'
        calls = 'call_body (", " call_body)*' if parallel else "call_body"
        return "\n".join(
            [
                _alternative("calls", answer_schema),
                f'calls: {marker} "[" {calls} "]"',
                _one_call_rule(tools, self.arguments_key),
            ]
        )

    def write_call(self, call: ToolCall) -> str:
        body = json.dumps(
            [{"name": call.name, "arguments": json.loads(call.arguments or "{}")}], ensure_ascii=False
        )
        return f"[TOOL_CALLS]{body}"


def format_named(name: str, marker_token_id: int | None = None) -> ToolFormat:
    if name == HERMES:
        return Hermes()
    if name == LLAMA3_JSON:
        return Llama3Json()
    if name == MISTRAL:
        return Mistral(marker_token_id)
    raise ValueError(f"unknown tool-call format {name!r}")
