"""The app attached to a local `kvscope serve` (a real uvicorn on a loopback port): over its
events stream every panel works as with a local engine; as a plain OpenAI server (the path
vLLM, SGLang and llama.cpp take) the chat streams, the probability panel shows the server's
top-K, the latency is timed here and the panels say what the server does not expose."""

from __future__ import annotations

import threading

import numpy as np
import openai
import pytest
from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, TEST_NUM_BLOCKS, start_tiny

from app.remote.target import RemoteTarget
from engine.config import EngineConfig, SamplingParams
from live.remote import REMOTE_TOP_K

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, snapshot_top_n=5, ignore_eos=True)
PROMPT = "Hello, who are you?"


@pytest.fixture
def server(tiny_loaded):
    """Per test: the app fixtures check that no engine thread outlives its test."""
    from engine.serve.server import BackgroundServer

    with BackgroundServer(EngineConfig(block_size=4, num_blocks=128), loaded=tiny_loaded) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_remote_threads_left():
    yield
    left = [t.name for t in threading.enumerate() if t.name == "kvscope-remote" and t.is_alive()]
    assert not left, "a remote client thread outlived its window"


def server_reply(server) -> str:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="tiny-random-llama", messages=[{"role": "user", "content": PROMPT}], temperature=0,
            max_tokens=PARAMS.max_new_tokens, extra_body={"ignore_eos": True},
        )  # fmt: skip
    return reply.choices[0].message.content


def attach_and_ask(qtbot, window, server, use_events: bool) -> None:
    window.controls.sampling.set_params(PARAMS)
    window.remote_views.attach(RemoteTarget.parse(server.url), use_events=use_events)
    qtbot.waitUntil(lambda: window.host.status().ready, timeout=LOAD_TIMEOUT_MS)
    window.controller.new_conversation()
    window.controller.send(PROMPT)
    assert window.controller.active is not None
    qtbot.waitUntil(lambda: window.controller.active is None, timeout=REPLY_TIMEOUT_MS)


def test_attached_to_kvscope_every_panel_works_from_its_events(qtbot, make_window, server):
    window = make_window(start=False)
    attach_and_ask(qtbot, window, server, use_events=True)
    host, live = window.host, window.host.live
    assert host.remote.events and host.remote.family == "kvscope"
    assert host.model_name == f"tiny-random-llama @ {RemoteTarget.parse(server.url).label} (kvscope)"
    conv = window.conversations.load(window.controller.conversation.id)
    reply = conv.messages[-1]
    assert reply.content == server_reply(server) and reply.model == host.model_name  # stored, server named
    # the remote engine's own state, folded from its events exactly as a local engine's
    assert live.page_map.num_blocks == 128
    truth = server.bridge.engine._call(
        lambda core: [(b.ref_cnt, b.num_tokens, b.block_hash is not None) for b in core.kv.pool.blocks]
    ).result(10)
    qtbot.waitUntil(lambda: not live.page_map.ref_count.any(), timeout=REPLY_TIMEOUT_MS)
    pm = live.page_map
    assert [(int(r), int(f), bool(c)) for r, f, c in zip(pm.ref_count, pm.fill, pm.cached)] == truth
    assert pm.cached.any()
    # the server samples its memory a few times a second: the first sample may follow a quick reply
    qtbot.waitUntil(lambda: len(live.memory) > 0, timeout=REPLY_TIMEOUT_MS)
    assert live.steps
    view = live.requests[window.controller.session.records[reply.id].request_id]
    assert len(view.tokens) == PARAMS.max_new_tokens
    # the app's own reply (the server's stream also carries server_reply's request, from another client)
    window.panels.probabilities.show_token(view.request_id, len(view.tokens) - 1)  # draws at once
    assert window.panels.probabilities.stages[0].name == "raw"  # the per-stage view, as locally
    assert not any(cover.covered for cover in window.remote_views.covers.values())
    qtbot.waitUntil(lambda: host.metrics_family == "kvscope", timeout=LOAD_TIMEOUT_MS)


def test_attached_as_a_plain_openai_server(qtbot, make_window, server, tiny_loaded):
    window = make_window(start=True)  # from a local engine to the remote one
    local_blocks = window.host.live.page_map.num_blocks
    attach_and_ask(qtbot, window, server, use_events=False)
    host, live = window.host, window.host.live
    assert host.attached and host.remote is not None and not host.remote.events
    # the local engine's model and pool are not the remote's: forgotten, not shown as if they were
    assert local_blocks and live.loaded is None and live.page_map.num_blocks == 0
    assert window.status.model.text() == host.model_name
    conv = window.conversations.load(window.controller.conversation.id)
    assert conv.messages[-1].content == server_reply(server)
    assert "(kvscope)" in conv.messages[-1].model
    # latency timed on this client: a point per token, the first from when the request was sent
    request_id = window.controller.session.records[conv.messages[-1].id].request_id
    view = live.requests[request_id]
    assert len(view.tokens) == PARAMS.max_new_tokens and view.finished.stats.ttft_s > 0
    rows = np.asarray(live.latency.column("request_id")) == request_id
    assert rows.sum() == PARAMS.max_new_tokens
    # the probability panel: the server's top-K, labelled, no per-stage view
    panel = window.panels.probabilities
    panel.show_token(request_id, 0)  # draws at once
    assert [s.name for s in panel.stages] == [REMOTE_TOP_K]
    assert len(panel.rows) == PARAMS.snapshot_top_n and panel.rows[0].drawn  # greedy: the likeliest
    assert "as the server reports it" in panel.header.text()
    assert "top-K logprobs" in panel.summary.text()
    # what the server does not expose is said, not drawn
    covers = window.remote_views.covers
    assert all(cover.covered for cover in covers.values())
    assert "not exposed by kvscope at 127.0.0.1:" in covers["page_map"].notice.text()
    assert "Roofline: not available" in covers["roofline"].notice.text()
    qtbot.waitUntil(lambda: len(host.metrics) >= 1, timeout=LOAD_TIMEOUT_MS)
    assert "kvscope: names" in window.remote_views.panel.header.text()
    # back to a local engine: the notices go, the panels are the local engine's again
    start_tiny(qtbot, window, tiny_loaded, EngineConfig(num_blocks=TEST_NUM_BLOCKS))
    assert host.remote is None and not host.attached
    assert not any(cover.covered for cover in covers.values())


def test_an_unreachable_server_is_a_clear_message(qtbot, make_window):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket closes
    window = make_window(start=False)
    with qtbot.waitSignal(window.host.model_load_failed, timeout=LOAD_TIMEOUT_MS) as blocker:
        window.remote_views.attach(RemoteTarget.parse(f"127.0.0.1:{port}"))
    assert blocker.args[0].startswith(f"cannot reach http://127.0.0.1:{port}")
    assert not window.host.status().ready


def test_the_attach_dialog_keeps_what_was_typed_when_the_url_is_bad(qtbot, make_window):
    from app.remote.attach_dialog import AttachDialog

    window = make_window(start=False)
    titles = [a.text() for a in window.menuBar().actions()]
    assert titles[-2:] == ["&Remote", "&Help"]
    dialog = AttachDialog("", window)
    qtbot.addWidget(dialog)
    dialog.url.setText("ftp://example")
    dialog.key.setText("secret")
    dialog.accept()
    assert dialog.result() == 0 and dialog.target is None
    assert "http:// or https://" in dialog.error.text() and dialog.url.text() == "ftp://example"
    dialog.url.setText("gpu-box:8000/v1")
    dialog.accept()
    assert dialog.target == RemoteTarget("http://gpu-box:8000", "secret")
