"""Chat templates as each tokenizer ships them: a system role where the template has one, the
system prompt merged into the first user turn where it has none (Gemma), plain text and a note
where the tokenizer has no template at all."""

import copy
import json

import pytest
from tiny_models import make_tiny_llama

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFailed, RequestStarted
from engine.model.loaded import LoadedModel
from engine.request import ChatMessage, Request
from engine.text.chat_template import (
    NOTE_PLAIN_TEXT,
    NOTE_SYSTEM_MERGED,
    chat_note,
    render_chat,
)

# google/gemma-2-2b-it's tokenizer_config.json chat_template, verbatim.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# A template that renders user and assistant turns and silently ignores any other role.
DROPS_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SYSTEM = "You answer in French."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": "How are you?"},
]


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_a_template_with_a_system_role_is_used_as_shipped(default_tokenizer):
    prompt = render_chat(default_tokenizer, CONVERSATION)
    expected = default_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt.text == expected and SYSTEM in prompt.text
    assert prompt.note == ""
    assert prompt.ids == default_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert chat_note(default_tokenizer) == ""


def test_gemma_system_prompt_is_merged_into_the_first_user_turn(default_tokenizer):
    tok = with_template(default_tokenizer, GEMMA_TEMPLATE)
    prompt = render_chat(tok, CONVERSATION)
    bos = tok.bos_token
    assert prompt.text == (
        f"{bos}<start_of_turn>user\n{SYSTEM}\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nBonjour<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert prompt.note == NOTE_SYSTEM_MERGED
    assert chat_note(tok) == NOTE_SYSTEM_MERGED
    # without a system prompt nothing changes and nothing is said
    plain = render_chat(tok, CONVERSATION[1:])
    assert plain.note == "" and SYSTEM not in plain.text


def test_a_template_that_drops_the_system_prompt_silently_gets_it_merged(default_tokenizer):
    tok = with_template(default_tokenizer, DROPS_SYSTEM_TEMPLATE)
    prompt = render_chat(tok, CONVERSATION)
    assert prompt.text.startswith(f"<|user|>{SYSTEM}\n\nHello\n")
    assert prompt.note == NOTE_SYSTEM_MERGED


def test_no_template_means_plain_text_and_a_note(default_tokenizer):
    tok = with_template(default_tokenizer, None)
    prompt = render_chat(tok, CONVERSATION)
    assert prompt.text == (f"{SYSTEM}\nUser: Hello\nAssistant: Bonjour\nUser: How are you?\nAssistant:")
    assert prompt.note == NOTE_PLAIN_TEXT
    assert prompt.ids == tok(prompt.text)["input_ids"]
    assert chat_note(tok) == NOTE_PLAIN_TEXT


@pytest.fixture(scope="module")
def tiny_model(default_tokenizer):
    return make_tiny_llama(vocab_size=len(default_tokenizer), seed=2)


def test_the_engine_prompts_with_the_merged_conversation_and_the_model_info_says_so(
    default_tokenizer, tiny_model
):
    tok = with_template(default_tokenizer, GEMMA_TEMPLATE)
    loaded = LoadedModel.from_model(tiny_model, tok, name="gemma-template", source="test")
    assert loaded.info.chat_note == NOTE_SYSTEM_MERGED
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64), events.append)
    request = Request.chat("Hello", system=SYSTEM, max_new_tokens=2, temperature=0.0)
    ids = engine.prompt_ids(request)
    assert (
        ids
        == render_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]).ids
    )
    assert tok.decode(ids).count(SYSTEM) == 1
    engine.add_request(request)
    assert [type(e) for e in events] == [RequestStarted]


def test_a_conversation_the_template_refuses_fails_with_one_line(default_tokenizer, tiny_model):
    tok = with_template(default_tokenizer, GEMMA_TEMPLATE)
    loaded = LoadedModel.from_model(tiny_model, tok, name="gemma-template", source="test")
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64), events.append)
    # two user turns in a row: Gemma's template refuses them, merged or not
    history = (ChatMessage("user", "one"),)
    engine.add_request(Request.chat("two", history=history, sampling=SamplingParams(max_new_tokens=2)))
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failed.message.startswith("The model's chat template refuses this conversation")
    assert "roles must alternate" in failed.message and "\n" not in failed.message


def test_the_cli_says_when_it_merges_the_system_prompt(default_tokenizer, tmp_path, capsys):
    from model_folders import save_tiny_model

    from engine.cli.main import main

    folder = save_tiny_model(tmp_path / "gemma-template", with_template(default_tokenizer, GEMMA_TEMPLATE))
    argv = ["generate", "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2", "--prompt", "Hi"]
    assert main([*argv, "--system", SYSTEM]) == 0
    assert f"note: {NOTE_SYSTEM_MERGED}" in capsys.readouterr().err
    assert main(argv) == 0  # no system prompt: nothing to say
    assert "note:" not in capsys.readouterr().err
    assert main([*argv, "--system", SYSTEM, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["chat_note"] == NOTE_SYSTEM_MERGED
