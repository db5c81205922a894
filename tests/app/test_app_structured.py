"""Structured output in the app: a chat's schema or grammar is checked as it is typed, kept with
the conversation, and every reply follows it, its mask the first stage in the probability
panel; a bad one never starts a reply."""

from __future__ import annotations

import json

import jsonschema
import pytest
from app_windows import REPLY_TIMEOUT_MS
from PySide6.QtWidgets import QDialogButtonBox

from app.chat.chat_settings import ChatSettings
from app.chat.structured_dialog import VALID, StructuredOutputDialog
from engine.config import GrammarSpec, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def ok_button(dialog):
    return dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)


def test_the_dialog_checks_as_you_type(qtbot, tmp_path):
    dialog = StructuredOutputDialog(None)
    qtbot.addWidget(dialog)
    assert dialog.chosen_kind == "off" and ok_button(dialog).isEnabled()
    dialog.kind.setCurrentIndex(dialog.kind.findData("json_schema"))
    assert not ok_button(dialog).isEnabled() and "needs its text" in dialog.status.text()
    dialog.editor.setPlainText('{"type": "frob"}')
    qtbot.waitUntil(lambda: "is invalid" in dialog.status.text(), timeout=5000)  # after the typing pause
    assert not ok_button(dialog).isEnabled()
    dialog.editor.setPlainText('{"type": "string", "format": "nope"}')
    assert "cannot be compiled" in dialog.check_now() and not ok_button(dialog).isEnabled()
    dialog.editor.setPlainText(json.dumps(PERSON))
    assert dialog.check_now() == "" and dialog.status.text() == VALID and ok_button(dialog).isEnabled()
    assert dialog.spec() == GrammarSpec("json_schema", json.dumps(PERSON))
    # choices one per line; a regex that does not parse
    dialog.kind.setCurrentIndex(dialog.kind.findData("choice"))
    dialog.editor.setPlainText("yes\n\nno\n")
    assert dialog.check_now() == "" and dialog.spec() == GrammarSpec("choice", '["yes", "no"]')
    dialog.kind.setCurrentIndex(dialog.kind.findData("regex"))
    dialog.editor.setPlainText("a(b")
    assert "cannot be compiled" in dialog.check_now()
    # a file: its kind from its name; one that cannot be read says so and changes nothing
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    assert dialog.load_file(str(grammar)) and dialog.chosen_kind == "gbnf" and dialog.check_now() == ""
    assert not dialog.load_file(str(tmp_path / "missing.json"))
    assert "cannot read missing.json" in dialog.status.text() and dialog.chosen_kind == "gbnf"


def test_a_chat_under_a_schema_replies_in_it_and_keeps_it(make_window, qtbot):
    window = make_window()
    window.controls.sampling.set_params(
        SamplingParams(temperature=1.0, seed=4, max_new_tokens=60, snapshot_top_n=6)
    )
    controller = window.controller
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    controller.set_chat_settings(ChatSettings(grammar=spec))
    assert window.chat.structured_label.text() == "replies follow a JSON Schema"
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        controller.send("Describe someone")
    event = finished.args[0]
    assert event.finish_reason == "stop"
    jsonschema.validate(json.loads(event.text), PERSON)
    # the probability panel shows the mask as the first stage of a token
    token = window.host.live.token(event.request_id, 4)
    controller.inspect_token(event.request_id, 4)
    panel = window.panels.probabilities
    assert [b.property("stage") for b in panel.stage_buttons.buttons()][:2] == ["raw", "grammar"]
    panel.select_stage("grammar")
    grammar = token.snapshot.grammar
    assert panel.summary.text().startswith(f"grammar: {grammar.allowed:,} of 49,152 tokens allowed")
    # kept with the conversation, and in the reply's settings
    stored = window.conversations.load(controller.conversation.id)
    assert ChatSettings.from_dict(stored.settings).grammar == spec
    assert stored.messages[-1].meta["sampling"]["grammar"] == {"kind": "json_schema", "text": spec.text}
    controller.new_conversation()
    controller.open_conversation(stored.id)
    assert controller.chat_settings.grammar == spec


def test_a_grammar_with_no_next_token_ends_the_reply_with_its_reason(make_window, qtbot):
    window = make_window()
    window.controls.sampling.set_params(SamplingParams(temperature=1.0, seed=1, max_new_tokens=10))
    controller = window.controller
    controller.set_chat_settings(ChatSettings(grammar=GrammarSpec("lark", 'start: "ab" /[b&&c]/')))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        controller.send("x")
    assert finished.args[0].finish_reason == "grammar" and finished.args[0].text == "ab"
    bubble = window.chat.transcript.bubbles[-1]
    assert "the grammar permitted no next token" in bubble._meta.text()


# ---- kvscope --json-schema / --regex / --grammar ------------------------------------------------
def test_the_launch_flags_become_the_chats_structured_output(tmp_path):
    from app.main import parse_args, structured_output
    from engine.config import ConfigError

    assert structured_output(parse_args([])) is None
    assert structured_output(parse_args(["--regex", "[0-9]{4}"])) == GrammarSpec("regex", "[0-9]{4}")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON), encoding="utf-8")
    assert structured_output(parse_args(["--json-schema", str(schema)])).kind == "json_schema"
    gbnf, lark = tmp_path / "yes.gbnf", tmp_path / "yes.txt"
    gbnf.write_text('root ::= "yes" | "no"', encoding="utf-8")
    lark.write_text('start: "yes" | "no"', encoding="utf-8")
    assert structured_output(parse_args(["--grammar", str(gbnf)])).kind == "gbnf"
    assert structured_output(parse_args(["--grammar", str(lark)])).kind == "lark"
    # what is wrong is said in one line naming the flag, before anything starts
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}', encoding="utf-8")
    for argv, words in (
        (["--regex", "[0-9"], "--regex: "),
        (["--json-schema", str(bad)], "--json-schema: "),
        (["--json-schema", str(tmp_path / "missing.json")], "--json-schema: cannot read"),
        (["--grammar", str(tmp_path / "missing.lark")], "--grammar: cannot read"),
    ):
        with pytest.raises(ConfigError) as refused:
            structured_output(parse_args(argv))
        assert str(refused.value).startswith(words) and "\n" not in str(refused.value), argv


def test_a_scripted_run_under_a_grammar_shows_its_mask_stage(
    make_window, qtbot, tiny_loaded, test_config, tmp_path
):
    from app.scripted import ScriptedRun, most_cut_token

    window = make_window(start=False)
    window.controls.sampling.set_params(
        SamplingParams(temperature=1.0, seed=2, max_new_tokens=30, snapshot_top_n=5)
    )
    window.controller.set_chat_settings(ChatSettings(grammar=GrammarSpec("json_schema", json.dumps(PERSON))))
    shot = tmp_path / "grammar.png"
    run = ScriptedRun(window, "Who?", shot, quit_after_reply=False, timeout_s=120)
    window.start_engine(test_config, loaded=tiny_loaded)
    qtbot.waitUntil(lambda: run.finished, timeout=REPLY_TIMEOUT_MS)
    assert run.exit_code == 0 and shot.is_file()
    jsonschema.validate(json.loads(run.reply), PERSON)
    view = window.host.live.requests[run.request_id]
    cut = most_cut_token(view.tokens)
    assert cut is not None and window.controller.pinning.pinned == (run.request_id, cut)
    panel = window.panels.probabilities
    assert panel.stage_name == "grammar" and not panel.grammar_note.isHidden()


def test_each_chat_tab_has_its_own_structured_output(make_window, qtbot):
    window = make_window()
    window.controls.sampling.set_params(SamplingParams(temperature=1.0, seed=4, max_new_tokens=12))
    first = window.controller
    second = window.chat_tabs.add_tab()
    second.set_chat_settings(ChatSettings(grammar=GrammarSpec("regex", "[0-9]{4}")))
    assert first.chat_settings.grammar is None
    assert "replies follow a regular expression" in second.pane.structured_label.text()
    assert first.pane.structured_label.text() == "free text"
    assert second.send("A year?") and first.send("A year?")  # both generate at once

    def both_replied() -> bool:
        return all(
            c.conversation is not None and c.conversation.messages[-1].finish_reason is not None
            for c in (first, second)
        )

    qtbot.waitUntil(both_replied, timeout=REPLY_TIMEOUT_MS)
    constrained = second.conversation.messages[-1]
    assert len(constrained.content) == 4 and constrained.content.isdigit()
    free = first.conversation.messages[-1]
    assert free.meta["sampling"].get("grammar") is None
    # a closed tab's controller hears nothing more from the MCP servers' changes
    window.chat_tabs.close_tab(1)
    qtbot.wait(50)
    window.tools.changed.emit()


def test_a_branch_inside_a_json_reply_in_the_chat(make_window, qtbot):
    window = make_window()
    window.controls.sampling.set_params(
        SamplingParams(temperature=1.0, seed=6, max_new_tokens=60, snapshot_top_n=6)
    )
    controller = window.controller
    controller.set_chat_settings(ChatSettings(grammar=GrammarSpec("json_schema", json.dumps(PERSON))))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        controller.send("Describe someone")
    first = finished.args[0]
    first_reply = controller.conversation.messages[-1]
    tokens = window.host.live.requests[first.request_id].tokens
    # a token inside the object where the mask left a choice: another permitted candidate
    at = next(t for t in tokens[2:] if sum(1 for p in t.snapshot.stages[1].probs if p > 0) > 1)
    allowed = zip(at.snapshot.candidate_ids, at.snapshot.stages[1].probs)
    other = next(c for c, p in allowed if p > 0 and c != at.token_id)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as branched:
        assert controller.branch_from_token(first.request_id, at.index, other)
    assert branched.args[0].finish_reason == "stop"
    reply = controller.conversation.messages[-1]
    jsonschema.validate(json.loads(reply.content), PERSON)  # the prefix, the candidate, the rest
    assert len(controller.conversation.siblings(reply)) == 2
    # a candidate the mask cut is refused before anything starts, with the reason
    controller.open_conversation(controller.conversation.id, first_reply.id)  # back to the first
    where = next(t for t in tokens if t.snapshot.grammar.cut_ids)
    cut = where.snapshot.grammar.cut_ids[0]
    nodes = len(controller.conversation.nodes)
    with qtbot.waitSignal(controller.status_message) as said:
        assert not controller.branch_from_token(first.request_id, where.index, cut)
    assert "does not allow that token there" in said.args[0] and said.args[1] == "error"
    assert len(controller.conversation.nodes) == nodes and not controller.busy
    # under another structured output (free text) the same candidate goes on
    controller.set_chat_settings(ChatSettings())
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        assert controller.branch_from_token(first.request_id, where.index, cut)
    assert len(controller.conversation.nodes) == nodes + 1
