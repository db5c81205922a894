"""A reply cut off by kill -9, for real: a kvscope window in another process branches a reply and
is killed while the branch streams. The database then holds the tree (the first reply and the
branch) and the branch's text as of its last checkpoint (the chat writes a streaming reply at
least once a second, so at most the last second of text is lost); the next start marks it
interrupted and Continue generates on from its stored tokens. Also: a reply left streaming in
a database shows as interrupted with Continue, and continuing it equals a fresh greedy run."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from app_windows import REPLY_TIMEOUT_MS

from app.chat.conversations import ConversationStore
from app.paths import conversations_db_path
from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import ChatMessage, Request

CHILD = Path(__file__).with_name("kill_child.py")
CHILD_TIMEOUT_S = 300


def read_lines(proc) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def greedy_after(tiny_loaded, messages, ids, n) -> tuple[int, ...]:
    events: list = []
    engine = LLMEngine(tiny_loaded, EngineConfig(num_blocks=256, enable_prefix_caching=False), events.append)
    template = engine.prompt_ids(Request(messages=messages))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=n)
    engine.add_request(Request(prompt_token_ids=(*template, *ids), sampling=params))
    while engine.has_work():
        engine.step()
    return next(e for e in events if isinstance(e, RequestFinished)).token_ids


def test_kill_9_mid_branch_keeps_the_tree_and_the_last_checkpoint_then_continues(
    make_window, qtbot, tiny_loaded
):
    proc = subprocess.Popen(
        [sys.executable, str(CHILD)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=str(CHILD.parent.parent.parent),
    )
    lines = read_lines(proc)
    said: dict[str, list] = {}
    try:
        while "SHOWN" not in said:
            line = lines.get(timeout=CHILD_TIMEOUT_S)
            assert line is not None and not line.startswith("TIMEOUT"), f"the child ended early: {said}"
            kind, _, payload = line.partition(" ")
            if kind in ("FIRST", "CHECKPOINT", "SHOWN"):
                said.setdefault(kind, []).append(json.loads(payload))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    first, last_checkpoint, shown = said["FIRST"][0], said["CHECKPOINT"][-1], said["SHOWN"][0]

    store = ConversationStore(conversations_db_path())
    conv = store.load(store.summaries()[0].id)
    branch = conv.nodes[last_checkpoint["message_id"]]
    assert branch.finish_reason is None  # as the kill left it: still "streaming"
    assert branch.content == last_checkpoint["text"] and branch.content  # the last checkpoint, whole
    assert shown.startswith(branch.content)  # what was lost is what came after it (< 1 s of text)
    assert len(branch.token_ids) == last_checkpoint["tokens"] > 3  # its tokens, saved with its text
    assert branch.token_ids[:3] == (*first["token_ids"][:2], first["chosen"])
    user = conv.nodes[branch.parent_id]
    assert [m.id for m in conv.children(user.id)] == [first["message_id"], branch.id]  # the tree is whole
    store.close()

    window = make_window()  # the next start: marks it interrupted, opens it
    assert window.interrupted_replies == 1
    assert window.controller.conversation.messages[-1].id == branch.id
    bubble = window.chat.transcript.bubbles[-1]
    assert "interrupted" in bubble._meta.text() and bubble.continue_button.isVisibleTo(bubble)
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=5))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        bubble.continue_button.click()
    more = finished.args[0]
    stored = window.conversations.load(window.controller.conversation.id).nodes[branch.id]
    assert stored.content.startswith(branch.content) and stored.finish_reason == "length"
    assert stored.token_ids == (*branch.token_ids, *more.token_ids) and len(more.token_ids) == 5
    messages = (ChatMessage("user", user.content),)
    assert more.token_ids == greedy_after(tiny_loaded, messages, branch.token_ids, 5)


def test_a_reply_left_streaming_is_marked_interrupted_and_continues_like_a_fresh_run(
    make_window, qtbot, tiny_loaded
):
    # What a crash leaves: the first 6 greedy tokens of a reply, stored mid-stream.
    messages = (ChatMessage("user", "Count with me"),)
    whole = greedy_after(tiny_loaded, messages, (), 10)
    store = ConversationStore(conversations_db_path())
    conv = store.create()
    store.add_message(conv.id, "user", "Count with me")
    cut = store.add_message(conv.id, "assistant", "(six tokens of text)", token_ids=whole[:6])
    store.close()

    window = make_window()
    bubble = window.chat.transcript.bubbles[-1]
    assert window.conversations.load(conv.id).nodes[cut.id].finish_reason == "interrupted"
    assert bubble.continue_button.isVisibleTo(bubble) and bubble.menu_actions["continue"].isEnabled()
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=4))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        bubble.continue_button.click()
    assert finished.args[0].token_ids == whole[6:10]  # greedy: the reply goes on as it would have
    stored = window.conversations.load(conv.id).nodes[cut.id]
    assert stored.token_ids == whole and stored.content.startswith("(six tokens of text)")
    assert not window.chat.transcript.bubbles[-1].continue_button.isVisibleTo(
        window.chat.transcript.bubbles[-1]
    )
