"""A request body's structured output and tools as the engine takes them.

`response_format` (OpenAI: `json_schema` with its schema, `json_object`) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark, or GBNF when it reads as GBNF) become one
`GrammarSpec`, compiled here once so that a schema or grammar the library cannot use is a 400
naming the field, before the engine sees it. `tools` and `tool_choice` become the engine's
`ToolSpec`s and choice; messages carry calls (assistant) and results (role `tool`).
"""

from __future__ import annotations

import json

from engine.config import ConfigError, GrammarSpec
from engine.events import ToolCall
from engine.grammar.compile import GrammarError, check
from engine.request import ToolSpec
from engine.serve.errors import ServeError
from engine.serve.protocol import ChatRequest, NamedToolChoice, SamplingFields, ToolCallIn
from engine.serve.tool_request import ToolRequest


def _refuse(param: str, message: str) -> ServeError:
    return ServeError(message, param=param, code="invalid_value")


def _spec(param: str, kind: str, text: str) -> GrammarSpec:
    try:
        spec = GrammarSpec(kind, text)
        check(spec)
    except (ConfigError, GrammarError) as exc:
        raise _refuse(param, f"{param}: {exc}") from None
    return spec


def grammar_of(body: SamplingFields) -> GrammarSpec | None:
    """The one grammar the body asks for (None: free text); two at once are refused."""
    asked: list[tuple[str, str, str]] = []
    if isinstance(body, ChatRequest) and body.response_format is not None:
        fmt = body.response_format
        if fmt.type == "json_object":
            asked.append(("response_format", "json_object", ""))
        elif fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
            if schema is None:
                raise _refuse("response_format.json_schema", "response_format json_schema needs its schema")
            asked.append(("response_format.json_schema.schema", "json_schema", json.dumps(schema)))
    if body.guided_json is not None:
        text = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(("guided_json", "json_schema", text))
    if body.guided_regex is not None:
        asked.append(("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        asked.append(("guided_choice", "choice", json.dumps(body.guided_choice)))
    if body.guided_grammar is not None:
        kind = "gbnf" if "::=" in body.guided_grammar else "lark"
        asked.append(("guided_grammar", kind, body.guided_grammar))
    if not asked:
        return None
    if len(asked) > 1:
        raise _refuse(asked[1][0], f"ask for one of {', '.join(a[0] for a in asked)}, not several")
    return _spec(*asked[0])


def tools_of(body: ChatRequest) -> ToolRequest | None:
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise _refuse("tool_choice", "tool_choice asks for a call, but the request offers no tools")
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        fn = tool.function
        parameters = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        try:
            _spec(f"tools.{i}.function.parameters", "json_schema", json.dumps(parameters))
            tools.append(ToolSpec(fn.name, fn.description, json.dumps(parameters)))
        except ConfigError as exc:
            raise _refuse(f"tools.{i}.function.name", str(exc)) from None
    if len({t.name for t in tools}) != len(tools):
        raise _refuse("tools", "two tools have the same name")
    choice = body.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.name for t in tools}:
            raise _refuse(
                "tool_choice.function.name", f"tool_choice names {name!r}, which is not one of the tools"
            )
        return ToolRequest(tuple(tools), "named", name, body.parallel_tool_calls)
    return ToolRequest(tuple(tools), choice, "", body.parallel_tool_calls)


def check_together(tools: ToolRequest | None, grammar: GrammarSpec | None) -> None:
    """The engine's rule (engine.tools.use) said before it starts, naming the field."""
    if tools is None or grammar is None or tools.tool_choice == "none":
        return
    if tools.constrained:
        raise _refuse(
            "tool_choice",
            f"tool_choice {tools.tool_choice!r} holds the reply to tool calls: it cannot also follow a {grammar.label}",
        )
    if grammar.kind not in ("json_schema", "json_object"):
        raise _refuse("tools", f"tools combine only with a JSON response format, not a {grammar.label}")


def tool_calls_of(index: int, calls: list[ToolCallIn] | None) -> tuple[ToolCall, ...]:
    """An assistant message's calls as the engine's, their arguments as JSON text."""
    out = []
    for j, call in enumerate(calls or ()):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise _refuse(
                    f"messages.{index}.tool_calls.{j}.function.arguments", "a call's arguments must be JSON"
                ) from None
            if not isinstance(parsed, dict):
                raise _refuse(
                    f"messages.{index}.tool_calls.{j}.function.arguments",
                    "a call's arguments must be a JSON object",
                )
            arguments = parsed
        out.append(ToolCall(call.function.name, json.dumps(arguments, ensure_ascii=False), call.id))
    return tuple(out)
