"""A kvscope window in a process of its own, for test_app_crash: it chats on the tiny model,
branches the reply from a token, and while the branch streams it reports every checkpoint the
chat writes to the database ("CHECKPOINT <json>"). After the second one it freezes the engine
(the reply is mid-stream for good), reports what the window shows ("SHOWN <json>") and waits to
be killed with SIGKILL. Not a test module: the test runs it with `python kill_child.py`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the worktree: app, engine

from PySide6.QtCore import QEventLoop, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

import app.chat.conversations as conversations  # noqa: E402
from app.chat.conversations import ConversationStore  # noqa: E402
from app.paths import conversations_db_path  # noqa: E402
from app.settings import AppSettings  # noqa: E402
from app.window import MainWindow  # noqa: E402
from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.model.default_model import load_default_tokenizer  # noqa: E402
from engine.model.loaded import LoadedModel  # noqa: E402


def say(kind: str, value) -> None:
    print(f"{kind} {json.dumps(value)}", flush=True)


def wait(condition, timeout_ms: int = 120_000) -> None:
    loop = QEventLoop()
    timer = QTimer()
    timer.timeout.connect(lambda: loop.quit() if condition() else None)
    timer.start(20)
    QTimer.singleShot(timeout_ms, loop.quit)
    loop.exec()
    timer.stop()
    if not condition():
        say("TIMEOUT", "")
        sys.exit(3)


def main() -> None:
    app = QApplication([])
    tokenizer = load_default_tokenizer()
    model = make_tiny_llama(vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    loaded = LoadedModel.from_model(model, tokenizer, name="tiny-random-llama", source="test")
    window = MainWindow(AppSettings(), ConversationStore(conversations_db_path()), interactive=False)
    window.show()
    window.start_engine(EngineConfig(num_blocks=256), loaded=loaded)
    wait(lambda: window.host.status().ready)
    controls = window.controls.sampling
    controls.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=6, snapshot_top_n=8))
    window.controller.send("Tell me a long story.")
    wait(lambda: window.controller.conversation is not None and window.controller.active is None and
         window.controller.conversation.messages[-1].finish_reason == "length")  # fmt: skip
    first = window.controller.conversation.messages[-1]
    record = window.controller.session.records[first.id]
    token = window.host.live.token(record.request_id, 2)
    chosen = next(t for t in token.snapshot.candidate_ids if t != token.token_id)
    say("FIRST", {"message_id": first.id, "token_ids": list(record.token_ids), "chosen": chosen})

    frozen = threading.Event()
    writes: list[str] = []
    original_write = conversations.ReplyCheckpoint._write

    def reporting_write(self, text, finish_reason, meta, token_ids, now):
        original_write(self, text, finish_reason, meta, token_ids, now)
        if finish_reason is None and self.message_id != first.id:
            say("CHECKPOINT", {"message_id": self.message_id, "text": text, "tokens": len(token_ids or ())})
            writes.append(text)
            if len(writes) == 2 and not frozen.is_set():
                freeze()

    core = window.host.engine.core
    step = core.step

    def freezable_step():
        if frozen.is_set():
            threading.Event().wait()  # never again: the reply stays mid-stream until the kill
        step()

    core.step = freezable_step

    def freeze():
        frozen.set()
        QTimer.singleShot(500, lambda: say("SHOWN", window.controller.active.text))

    conversations.ReplyCheckpoint._write = reporting_write
    controls.set_params(
        SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=1500, snapshot_top_n=8)
    )
    window.controller.branch_from_token(record.request_id, 2, chosen)
    app.exec()


if __name__ == "__main__":
    main()
