"""Tool calls in the engine: each family's format parsed (and a malformed call kept raw with
its error), tools rendered by a template that knows them or written into the prompt for one
that does not, and a required call held to its format by a grammar (tiny random Llama with the
real SmolLM2 tokenizer)."""

import copy
import json

import jsonschema
import pytest
from recorded_engine import make_engine, run_events

from engine.config import EngineConfig, GrammarSpec, SamplingParams
from engine.events import RequestFailed, RequestFinished, ToolCall, ToolCallsParsed
from engine.grammar.compile import check
from engine.request import ChatMessage, Request, ToolSpec
from engine.text.chat_template import prompt_ids
from engine.tools.formats import Hermes, Llama3Json, Mistral
from engine.tools.render import NOTE_TOOLS_IN_PROMPT, tool_template

WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    ),
)
ADD = ToolSpec(
    "add",
    "Add two integers",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        }
    ),
)
TOOLS = (WEATHER, ADD)
ASK = (ChatMessage("user", "What is the weather in Paris?"),)

# A template in Qwen 2.5's manner (written for this test): tools in the system turn, calls as
# <tool_call> blocks, results as <tool_response> in a user turn.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function inside <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA_LIKE = (
    "{%- if tools %}<|start_header_id|>user<|end_header_id|>Given the following functions, respond with a JSON "
    'for a function call in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{%- endif %}"
)


# ---- parsing ------------------------------------------------------------------------------------
def test_hermes_calls_and_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    reply = Hermes().parse(text, TOOLS)
    assert reply.content == "Let me look." and not reply.error
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(c.id.startswith("call_") for c in reply.calls) and len({c.id for c in reply.calls}) == 2
    assert text[reply.start : reply.end] == reply.raw and reply.raw.startswith("<tool_call>")
    assert Hermes().parse("Just words.", TOOLS).calls == ()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>',
            "call 1 is not valid JSON",
        ),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "no closing </tool_call>"),
        ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', "there is no tool named 'launch'"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'a call is an object with a "name"'),
        ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "not a JSON object"),
    ],
)
def test_a_malformed_hermes_call_is_kept_raw_with_its_error(text, error):
    reply = Hermes().parse(text, TOOLS)
    assert reply.calls == () and error in reply.error and reply.raw == text.strip()


def test_llama3_json_calls():
    fmt = Llama3Json()
    reply = fmt.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
        TOOLS,
    )
    assert [c.name for c in reply.calls] == ["add", "get_weather"] and json.loads(
        reply.calls[1].arguments
    ) == {"city": "Oslo"}
    assert fmt.parse('{"answer": 42}', TOOLS).calls == ()  # JSON that is no call is content
    bad = fmt.parse('{"name": "add", "parameters": {"a": 1,', TOOLS)
    assert bad.error.startswith("call 1 is not valid JSON") and bad.raw


def test_mistral_calls_old_and_new():
    fmt = Mistral()
    old = fmt.parse(
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        TOOLS,
    )
    assert [c.name for c in old.calls] == ["add", "get_weather"] and not old.error
    new = fmt.parse(
        '[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', TOOLS
    )
    assert [(c.name, json.loads(c.arguments)) for c in new.calls] == [
        ("add", {"a": 5, "b": 6}),
        ("get_weather", {"city": "Lima"}),
    ]
    assert fmt.parse('[TOOL_CALLS][{"name": "add", "argu', TOOLS).error


@pytest.mark.parametrize("fmt", [Hermes(), Llama3Json(), Mistral()], ids=lambda f: f.name)
def test_each_format_writes_a_grammar_that_compiles_and_its_calls_parse(fmt, default_tokenizer):
    for parallel in (False, True):
        text = fmt.grammar(TOOLS, parallel)
        assert check(GrammarSpec("lark", text))
    # two calls in a row are what the parallel grammar takes, whole
    import llguidance

    from engine.grammar.vocab import grammar_tokenizer

    vocab = grammar_tokenizer(default_tokenizer, len(default_tokenizer), {2})
    two = {
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    }[fmt.name]
    matcher = llguidance.LLMatcher(vocab, check(GrammarSpec("lark", fmt.grammar(TOOLS, True))), log_level=0)
    ids = default_tokenizer(two, add_special_tokens=False)["input_ids"]
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    assert len(fmt.parse(two, TOOLS).calls) == 2
    call = ToolCall("add", '{"a": 1, "b": 2}', "x")
    written = fmt.write_call(call)
    assert [(c.name, c.arguments) for c in fmt.parse(written, TOOLS).calls] == [("add", '{"a": 1, "b": 2}')]


# ---- rendering ----------------------------------------------------------------------------------
def test_a_template_without_tools_gets_them_in_the_system_prompt(default_tokenizer):
    template = tool_template(default_tokenizer)
    assert not template.native and template.format.name == "hermes" and template.note == NOTE_TOOLS_IN_PROMPT
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_1")
    follow = ASK + (
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", '{"temp": 18}', tool_call_id="call_1", name="get_weather"),
    )
    text = default_tokenizer.decode(prompt_ids(default_tokenizer, Request(messages=follow, tools=TOOLS)))
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>' in text
    # tool_choice none: no tools offered
    plain = default_tokenizer.decode(
        prompt_ids(default_tokenizer, Request(messages=ASK, tools=TOOLS, tool_choice="none"))
    )
    assert "<tools>" not in plain


@pytest.fixture
def qwen_like(default_tokenizer):
    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = QWEN_LIKE
    return tok


def test_a_template_that_renders_tools_is_used_as_it_is(qwen_like):
    template = tool_template(qwen_like)
    assert template.native and template.format.name == "hermes" and template.note == ""
    call = ToolCall("add", '{"a": 1, "b": 2}', "call_1")
    follow = ASK + (
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "3", tool_call_id="call_1"),
    )
    text = qwen_like.decode(prompt_ids(qwen_like, Request(messages=follow, tools=TOOLS)))
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and "kvscope" not in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text


def test_the_format_is_read_off_the_template(default_tokenizer):
    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = LLAMA_LIKE
    assert tool_template(tok).format.name == "llama3_json" and tool_template(tok).native


# ---- generation ---------------------------------------------------------------------------------
run = run_events


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    return make_engine(tiny_loaded, EngineConfig(block_size=16, num_blocks=300))


@pytest.mark.parametrize(("choice", "name"), [("required", ""), ("named", "add")])
def test_a_required_call_follows_the_format_and_the_tool_schema(engine, choice, name):
    params = SamplingParams(temperature=1.0, seed=4, max_new_tokens=150)
    request = Request(
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=False,
        sampling=params,
    )
    events = run(engine, request)
    (parsed,) = [e for e in events if isinstance(e, ToolCallsParsed)]
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert finished and finished[0].finish_reason == "stop" and not parsed.error
    assert len(parsed.calls) == 1 and (choice == "required" or parsed.calls[0].name == "add")
    for call in parsed.calls:
        tool = next(t for t in TOOLS if t.name == call.name)
        jsonschema.validate(json.loads(call.arguments), json.loads(tool.parameters))
    # the calls' tokens are the whole reply (nothing before them under the grammar)
    assert parsed.token_start == 0 and parsed.token_end == len([t for t in finished[0].token_ids if t != 2])


def test_auto_lets_the_model_answer_in_words(engine):
    params = SamplingParams(temperature=1.0, seed=4, max_new_tokens=12)
    events = run(engine, Request(messages=ASK, tools=TOOLS, sampling=params))
    (parsed,) = [e for e in events if isinstance(e, ToolCallsParsed)]
    assert parsed.calls == () and parsed.error == "" and parsed.content


def test_a_required_call_and_a_response_format_cannot_both_hold(engine):
    params = SamplingParams(grammar=GrammarSpec("json_object"))
    events = run(engine, Request(messages=ASK, tools=TOOLS, tool_choice="required", sampling=params))
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert "cannot also follow" in failed.message


def test_n_samples_with_tools_each_get_their_calls_read(engine):
    params = SamplingParams(temperature=1.0, seed=9, n=2, max_new_tokens=150)
    request = Request(
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, sampling=params
    )
    events = run(engine, request)
    parsed = [e for e in events if isinstance(e, ToolCallsParsed)]
    assert sorted(p.branch for p in parsed) == [0, 1] and all(p.calls for p in parsed)
