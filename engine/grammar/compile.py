"""Grammar specs -> llguidance grammars, with a one-line message for anything that cannot compile.

Why llguidance and not xgrammar (measured on this 2-core machine over the packaged SmolLM2's
49,152-token vocabulary, `python -m engine bench --grammar --grammar-libraries`): llguidance
compiles a schema in ~1 ms against xgrammar's 5-11 ms, and computes a mask in a median of
15-100 us a token against xgrammar's 2-20 us; both are under 1% of a decode step here (~20 ms),
so speed does not decide. Correctness does: xgrammar's JSON masks allowed the tokenizer's special
tokens (<|endoftext|>, <|im_start|>, ...) inside strings, so a sample could end its reply in the
middle of a string; llguidance keeps special tokens out unless a grammar names them, and keeps
forced text (an object's keys) to its canonical tokens. It also reads Lark grammars (with JSON
Schema terminals inside them, which tool calls need) and converts GBNF, and it is a small wheel
(xgrammar brings triton and a TVM runtime). The libraries also differ in what a schema means:
llguidance follows JSON Schema (properties not listed are allowed unless additionalProperties is
false), xgrammar's default strict mode forbids them.

JSON is generated without free whitespace (", " and ": " separators, as json.dumps writes them):
with whitespace left to the model, small models are known to fill a reply with newlines.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import jsonschema
import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.config import GrammarSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# How JSON is laid out under a schema (llguidance's JsonCompileOptions).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_MESSAGE_CHARS = 300


class GrammarError(ValueError):
    """A grammar or schema that cannot be used; the message is one line for the user."""


def one_line(message: str) -> str:
    """llguidance's messages come with the grammar quoted and a caret under the fault: keep the
    first line and, for a regex, the line that names the error."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    first = lines[0].rstrip(":")
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    text = f"{first}: {detail.removeprefix('error:').strip()}" if detail else first
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(
            f"the {what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def check_schema(schema: Any) -> None:
    """A JSON Schema checked against its own meta-schema (the draft it names, else 2020-12)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON Schema is an object (or true/false), not {type(schema).__name__}")
    if isinstance(schema, bool):
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(
            f"the JSON Schema is invalid: {one_line(exc.message)}" + (f" (at {where})" if where else "")
        ) from None


def grammar_text(spec: GrammarSpec) -> str:
    """`spec` in llguidance's grammar form (syntax errors of the text raise here; whether the
    grammar compiles is `check`'s question)."""
    if spec.kind == "json_schema":
        schema = _json(spec.text, "schema")
        check_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "lark":
        if spec.text.lstrip().startswith("{"):  # llguidance would read it as its own JSON form
            raise GrammarError("this is JSON, not a Lark grammar: a JSON Schema goes in as a schema")
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    if spec.kind == "gbnf":
        try:
            lark = any_to_lark(spec.text)
        except Exception as exc:  # noqa: BLE001 - the converter raises its own and plain errors
            raise GrammarError(f"the GBNF grammar does not parse: {one_line(str(exc))}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    assert spec.kind == "choice", "GrammarSpec checks its kind"
    choices = _json(spec.text, "list of choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError('the choices must be a JSON array of non-empty strings, e.g. ["yes", "no"]')
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def check(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The compiled grammar's text, or GrammarError saying in one line why there is none.
    Without a tokenizer the check is the grammar's own (what the app does as you type); with
    one it is also checked against that vocabulary."""
    try:
        text = grammar_text(spec)
    except GrammarError:
        raise
    except ValueError as exc:  # llguidance's own refusals (a schema's integer past 64 bits, say)
        raise GrammarError(f"the {spec.label} cannot be used: {one_line(str(exc))}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error:
        raise GrammarError(f"the {spec.label} cannot be compiled: {one_line(messages[0])}")
    return text
