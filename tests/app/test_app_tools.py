"""Tools in the app: a real MCP server written with the `mcp` SDK (tests/app/mcp_test_server.py),
started by the test over stdio or HTTP, its tools offered to the tiny model in a chat; the call
shows as a card (raw tokens, name and arguments), runs once approved, and its result goes to the
model in the next reply, whose prompt blocks holding it the card names. And the bad cases: a
server that does not start, a tool that hangs, crashes or returns 10 MB, a call that does not
parse: each a message, none a hang."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from app_windows import REPLY_TIMEOUT_MS

from app.chat.chat_settings import ChatSettings
from app.tools.mcp_hub import RESULT_CHARS, McpServerConfig
from engine.config import SamplingParams

SERVER = Path(__file__).with_name("mcp_test_server.py")
STDIO = f"{sys.executable} {SERVER}"
# The tiny model is random: at temperature 1 the call it writes under the tool grammar closes
# within a reply's budget only for some seeds (the schemas admit more keys, and it may go on
# writing one). Under this seed all three calls below close; another draw order (sampler.draw
# among the tokens with probability) needed another seed than the 3 and 5 these tests had.
CLOSING_SEED = 6
CONNECT_TIMEOUT_MS = 60_000


def connected(qtbot, registry, config: McpServerConfig):
    assert registry.add(config) == ""
    qtbot.waitUntil(lambda: registry.servers[config.name].state != "connecting", timeout=CONNECT_TIMEOUT_MS)
    return registry.servers[config.name]


@pytest.fixture
def registry(qtbot):
    from app.tools.registry import ToolRegistry

    made = ToolRegistry(None, call_timeout_s=2.0)
    yield made
    made.close()


def outcome_of(qtbot, registry, name: str, arguments: dict):
    got = []
    registry.call(name, arguments, got.append)
    qtbot.waitUntil(lambda: bool(got), timeout=180_000)
    return got[0]


def test_a_stdio_server_lists_its_tools_and_answers_calls(qtbot, registry):
    state = connected(qtbot, registry, McpServerConfig("test", command=STDIO))
    assert state.state == "ready", state.message
    assert {t.name for t in state.tools} == {"add", "echo", "hang", "crash", "big"}
    add = next(t for t in state.tools if t.name == "add")
    assert json.loads(add.input_schema)["properties"]["a"]["maximum"] == 9
    assert [s.name for s in registry.tool_specs()] == [t.name for t in state.tools]
    assert outcome_of(qtbot, registry, "add", {"a": 2, "b": 3}).text == "5"


def test_a_tool_that_hangs_crashes_or_floods_is_an_outcome_not_a_hang(qtbot, registry):
    connected(qtbot, registry, McpServerConfig("test", command=STDIO))
    hang = outcome_of(qtbot, registry, "hang", {})
    assert hang.status == "timeout" and "did not answer within 2 s" in hang.text
    crash = outcome_of(qtbot, registry, "crash", {})
    assert crash.status == "error" and "crash" in crash.text
    registry.call_timeout_s = 120.0  # 10 MB over a pipe takes seconds on a busy machine
    big = outcome_of(qtbot, registry, "big", {})
    assert big.status == "done" and big.truncated and big.size == 10 * 2**20
    assert len(big.text) < RESULT_CHARS + 200 and "the tool returned 10,485,760 characters" in big.text
    bad = outcome_of(qtbot, registry, "add", {"a": "x", "b": 1})
    assert bad.status == "error"
    assert outcome_of(qtbot, registry, "add", {"a": 1, "b": 1}).text == "2"  # the session still works
    missing = outcome_of(qtbot, registry, "launch", {})
    assert missing.status == "error" and "no connected MCP server" in missing.text


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("/nonexistent/mcp-server --flag", "the command was not found"),
        (
            f"{sys.executable} -c \"import sys; sys.stderr.write('no config file\\n'); sys.exit(3)\"",
            "no config file",
        ),
    ],
)
def test_a_server_that_does_not_start_says_why(qtbot, registry, command, words):
    state = connected(qtbot, registry, McpServerConfig("broken", command=command))
    assert state.state == "failed" and words in state.message and "\n" not in state.message
    assert registry.tool_specs() == ()


def test_a_bad_server_entry_is_refused_before_it_starts(registry):
    assert "either a command" in registry.add(McpServerConfig("x"))
    assert "http://" in registry.add(McpServerConfig("x", url="ftp://host/mcp"))
    assert "does not parse" in registry.add(McpServerConfig("x", command='python "unclosed'))


class MemorySettings:
    """AppSettings' get/set, in memory: what the registry saves for the next start."""

    def __init__(self) -> None:
        self.values: dict = {}

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value) -> None:
        self.values[key] = value


def test_the_servers_dialog_adds_a_server_and_lists_its_tools(qtbot):
    from app.tools.registry import ToolRegistry
    from app.tools.servers_dialog import ServersDialog

    settings = MemorySettings()
    registry = ToolRegistry(settings, call_timeout_s=2.0)
    try:
        dialog = ServersDialog(registry)
        qtbot.addWidget(dialog)
        assert "No MCP servers yet" in dialog.message.text()
        # a bad entry is refused in the dialog, and nothing is started or saved
        dialog.name.setText("broken")
        dialog.add_button.click()
        assert dialog.message.text().startswith("✗") and "either a command" in dialog.message.text()
        assert registry.servers == {} and dialog.name.text() == "broken"  # what was typed stays
        # a stdio command: it starts, then its tools are listed under it
        dialog.target.setText(STDIO)
        dialog.add_button.click()
        assert "Starting it" in dialog.message.text() and dialog.tree.topLevelItemCount() == 1
        qtbot.waitUntil(lambda: registry.servers["broken"].state != "connecting", timeout=CONNECT_TIMEOUT_MS)
        item = dialog.tree.topLevelItem(0)
        assert item.text(1) == "ready", item.text(2)
        listed = {item.child(i).text(0): item.child(i).text(2) for i in range(item.childCount())}
        assert set(listed) == {"add", "echo", "hang", "crash", "big"}
        assert listed["add"] == "Add two one-digit integers"
        # kept for the next start, and a second registry reading the settings connects it again
        assert settings.values["tools/mcp_servers"] == [{"name": "broken", "command": STDIO, "url": ""}]
        again = ToolRegistry(settings)
        try:
            again.load()
            assert list(again.servers) == ["broken"]
            qtbot.waitUntil(lambda: again.servers["broken"].state != "connecting", timeout=CONNECT_TIMEOUT_MS)
            assert again.servers["broken"].state == "ready"
        finally:
            again.close()
            # its finished connect job is deleted later: let that happen before `again` goes (a
            # QObject deleted with a deleteLater pending under it crashes PySide)
            qtbot.wait(200)
        # removed from the dialog: gone from the list and from the settings
        dialog.tree.setCurrentItem(item.child(0))  # a tool's row names its server
        dialog.remove_button.click()
        assert registry.servers == {} and dialog.tree.topLevelItemCount() == 0
        assert settings.values["tools/mcp_servers"] == []
    finally:
        registry.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_http_server_is_reached_by_its_url(qtbot, registry):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        state = connected(qtbot, registry, McpServerConfig("web", url=f"http://127.0.0.1:{port}/mcp"))
        assert state.state == "ready", state.message
        assert outcome_of(qtbot, registry, "echo", {"text": "hi"}).text == "echo: hi"
    finally:
        proc.terminate()
        proc.wait(10)


# ---- the chat --------------------------------------------------------------------------------
def test_a_tool_call_in_the_chat_is_approved_run_and_read_by_the_next_reply(make_window, qtbot):
    window = make_window()
    window.tools.call_timeout_s = 10.0
    state = connected(qtbot, window.tools, McpServerConfig("test", command=STDIO))
    assert state.state == "ready", state.message
    window.controls.sampling.set_params(
        SamplingParams(temperature=1.0, seed=CLOSING_SEED, max_new_tokens=60, snapshot_top_n=4)
    )
    controller = window.controller
    controller.set_chat_settings(ChatSettings(tools=True, tool_choice="add"))
    assert window.chat.tools_check.isChecked() and "tools from 1 MCP server" in window.chat.tools_label.text()

    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as first:
        controller.send("What is 2 + 3?")
    call_reply = controller.conversation.messages[-1]
    record = call_reply.meta["tool_calls"]
    (call,) = record["calls"]
    assert call["name"] == "add" and call["status"] == "pending" and call["server"] == "test"
    arguments = json.loads(call["arguments"])
    assert set(arguments) == {"a", "b"} and first.args[0].finish_reason == "stop"
    # the card: the tokens the model wrote, the call read from them, the approval it waits for
    bubble = window.chat.transcript.bubbles[-1]
    (card,) = bubble.tool_cards
    raw = card.raw.text()
    assert raw.count("·") > 10 and "tool" in raw and "call" in raw and "add" in raw  # token by token
    assert "add" in card.title.text() and '"a"' in card.arguments.text()
    assert not card.run_button.isHidden() and "waiting for your approval" in card.status.text()
    assert controller.active is None  # nothing runs before the user says so

    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as second:
        card.allow_button.click()  # run it, and allow add in this chat from now on
    call = controller.conversation.nodes[call_reply.id].meta["tool_calls"]["calls"][0]
    assert call["status"] == "done" and call["result"] == str(arguments["a"] + arguments["b"])
    assert controller.chat_settings.allowed_tools == ("add",)
    stored = window.conversations.load(controller.conversation.id)
    assert stored.settings["allowed_tools"] == ["add"]
    # the next reply answers the call message, and its prompt holds the call and its result
    answer = controller.conversation.messages[-1]
    assert answer.role == "assistant" and answer.parent_id == call_reply.id
    request = window.host.request(second.args[0].request_id)
    roles = [m.role for m in request.messages]
    assert roles[-2:] == ["assistant", "tool"] and request.messages[-1].content == call["result"]
    assert request.messages[-2].tool_calls[0].name == "add"
    # the card names the KV blocks the result took in that reply's prompt
    qtbot.waitUntil(
        lambda: "blocks" in controller.conversation.nodes[call_reply.id].meta["tool_calls"]["calls"][0],
        timeout=REPLY_TIMEOUT_MS,
    )
    call = controller.conversation.nodes[call_reply.id].meta["tool_calls"]["calls"][0]
    start, end = call["result_tokens"]
    block_size = window.host.live.page_map.block_size
    assert call["blocks"] and len(call["blocks"]) == len({p // block_size for p in range(start, end)})
    card = next(
        c for b in window.chat.transcript.bubbles if b.message_id == call_reply.id for c in b.tool_cards
    )
    assert "KV block" in card.blocks.text() and f"#{call['blocks'][0]}" in card.blocks.text()

    # reopened, the conversation shows the same cards from what it stored
    controller.new_conversation()
    controller.open_conversation(stored.id)
    shown = next(b for b in window.chat.transcript.bubbles if b.message_id == call_reply.id)
    assert len(shown.tool_cards) == 1 and "done" in shown.tool_cards[0].status.text()


def test_the_context_meter_counts_the_tools_a_reply_would_offer(make_window, qtbot):
    window = make_window()
    connected(qtbot, window.tools, McpServerConfig("test", command=STDIO))
    controller = window.controller

    def measured() -> int:
        controller.session.last_fit = None
        controller.context.measure_now()
        qtbot.waitUntil(lambda: controller.session.last_fit is not None, timeout=REPLY_TIMEOUT_MS)
        return controller.session.last_fit.prompt_tokens

    window.chat.input.setPlainText("What is 2 + 3?")
    without = measured()
    controller.set_chat_settings(ChatSettings(tools=True))
    with_tools = measured()
    assert with_tools > without + 20  # five tools' names, descriptions and schemas in the prompt


def test_a_denied_call_is_told_to_the_model(make_window, qtbot):
    window = make_window()
    connected(qtbot, window.tools, McpServerConfig("test", command=STDIO))
    window.controls.sampling.set_params(SamplingParams(temperature=1.0, seed=CLOSING_SEED, max_new_tokens=40))
    controller = window.controller
    controller.set_chat_settings(ChatSettings(tools=True, tool_choice="echo"))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        controller.send("Say hi")
    call_reply = controller.conversation.messages[-1]
    (card,) = window.chat.transcript.bubbles[-1].tool_cards
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as answered:
        card.deny_button.click()
    assert call_reply.meta["tool_calls"]["calls"][0]["status"] == "denied"
    request = window.host.request(answered.args[0].request_id)
    assert request.messages[-1].content == "error: the user did not allow this call"


def test_a_call_that_does_not_parse_is_shown_raw_with_its_error(make_window, qtbot):
    from engine.events import ToolCallsParsed

    window = make_window()
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, max_new_tokens=4))
    controller = window.controller
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        controller.send("hi")
    reply = controller.conversation.messages[-1]
    broken = ToolCallsParsed(
        1, "hermes", "", (), '<tool_call>\n{"name": "add", "argu', 0, 0, "call 1 has no closing </tool_call>"
    )

    class Finished:
        tool_calls = broken

    reply.meta = controller.tool_rounds.with_tool_calls(Finished, reply.meta)
    bubble = window.chat.transcript.bubbles[-1]
    controller.tool_rounds.show_cards(bubble, reply)
    (card,) = bubble.tool_cards
    assert "does not parse" in card.title.text() and "no closing" in card.status.text()
    assert "tool_call" in card.raw.text() and card.run_button.isHidden()
    with qtbot.waitSignal(controller.status_message) as said:
        controller.tool_rounds.start_round(reply)
    assert "does not parse" in said.args[0] and controller.active is None  # nothing runs, nothing is lost


def test_calls_and_results_survive_export_and_import(make_window, qtbot, tmp_path):
    from app.chat.exchange import export_json, export_markdown, import_json

    window = make_window()
    connected(qtbot, window.tools, McpServerConfig("test", command=STDIO))
    window.controls.sampling.set_params(SamplingParams(temperature=1.0, seed=CLOSING_SEED, max_new_tokens=40))
    controller = window.controller
    controller.set_chat_settings(ChatSettings(tools=True, tool_choice="add", allowed_tools=("add",)))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        controller.send("What is 1 + 1?")
    qtbot.waitUntil(
        lambda: len(controller.conversation.messages) == 3 and controller.active is None,
        timeout=REPLY_TIMEOUT_MS,
    )
    conv = window.conversations.load(controller.conversation.id)
    text = export_json(conv)
    new_id = import_json(window.conversations, text)
    again = window.conversations.load(new_id)
    assert export_json(again) == text.replace(f'"current": {3}', '"current": 3')
    call_reply = again.messages[1]
    assert call_reply.meta["tool_calls"]["calls"][0]["status"] == "done"
    assert again.settings["tool_choice"] == "add"
    assert "**Tool call** `add`" in export_markdown(again)
