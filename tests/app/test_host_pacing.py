"""The render timer stays at its fastest rate until a reply's first token is on screen."""

from __future__ import annotations

from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS

from app.engine_host import EngineHost
from engine.config import EngineConfig, SamplingParams
from engine.request import Request


def test_a_reply_is_due_its_first_token_until_one_is_shown(qtbot, tiny_loaded):
    host = EngineHost()
    with qtbot.waitSignal(host.model_loaded, timeout=LOAD_TIMEOUT_MS):
        host.start(EngineConfig(block_size=4, num_blocks=64, max_model_len=128), loaded=tiny_loaded)
    try:
        assert not host.first_token_due()
        due_when_shown: list[bool] = []
        host.tokens_generated.connect(lambda request_id, batch: due_when_shown.append(host.first_token_due()))
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        with qtbot.waitSignal(host.request_finished, timeout=REPLY_TIMEOUT_MS):
            host.submit(Request(prompt_token_ids=(1, 2, 3), sampling=params))
            assert host.first_token_due()
        assert due_when_shown and not any(due_when_shown)
        assert not host.first_token_due()
    finally:
        assert host.shutdown(30)
