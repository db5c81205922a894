"""App test fixtures: isolated user dirs and settings, windows on the tiny model, and checks
that fail a test which leaves an engine thread or a running timer behind."""

from __future__ import annotations

import gc
import json
import threading

import pytest
import shiboken6
from app_windows import TEST_NUM_BLOCKS, TINY_REPO, start_tiny
from hub_server import HubServer, Repo, repo_from_folder, use_hub
from PySide6.QtCore import QTimer
from tiny_models import make_tiny_llama

# Every thread the app starts is named "kvscope-..." (the engine's, and each app.workers job's):
# none may outlive the test that started it.
APP_THREAD_PREFIX = "kvscope-"


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVSCOPE_CONFIG_DIR", str(tmp_path / "config"))


@pytest.fixture(autouse=True, scope="session")
def collect_what_was_frozen():
    """Objects frozen by no_app_threads_left are collectable again once the tests are done, while
    Qt is still up (their Qt parts are deleted on the GUI thread, not at interpreter exit)."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def no_app_threads_left():
    # Qt objects a finished test left in reference cycles are collected here, on the GUI thread:
    # collected later by a collection that runs on a worker thread, their deletion is deferred
    # to the GUI thread by shiboken, and crashes there once Qt has torn their parents down.
    gc.collect()
    # What survived is live: frozen out of later collections, so each test's collections scan
    # only what tests made since (a full collection over the process's millions of objects, two
    # or three a test, took most of the app tests' time). Unfrozen at the end of the session.
    gc.freeze()
    yield
    for thread in threading.enumerate():
        if thread.name == "kvscope-inspect":
            thread.join(10)  # metadata reads finish on their own; give them the moment they need
    left = [t.name for t in threading.enumerate() if t.name.startswith(APP_THREAD_PREFIX) and t.is_alive()]
    assert not left, f"threads left running after the test: {left}"


@pytest.fixture
def test_config():
    from engine.config import EngineConfig

    return EngineConfig(num_blocks=TEST_NUM_BLOCKS)


@pytest.fixture
def make_window(qtbot, tiny_loaded, test_config):
    """make_window(start=True) -> a shown MainWindow; engine on the tiny model when `start`.
    At teardown each window is closed and must leave no engine thread and no active timer."""
    from app.chat.conversations import ConversationStore
    from app.paths import conversations_db_path
    from app.settings import AppSettings
    from app.window import MainWindow

    made = []
    running_before = {id(t) for t in active_timers()}

    def make(start: bool = True, interactive: bool = False):
        store = ConversationStore(conversations_db_path())
        window = MainWindow(AppSettings(), store, interactive=interactive)
        made.append((window, store))
        window.show()
        if start:
            start_tiny(qtbot, window, tiny_loaded, test_config)
        return window

    yield make
    for window, store in made:
        window.close()
        store.close()
        assert not window.host.threads_alive(), "the engine thread outlived its window"
    left = [repr(t) for t in active_timers() if id(t) not in running_before]
    assert not left, f"timers still running after the windows closed: {left}"
    assert gc.isenabled(), "automatic garbage collection still off after the windows closed (app/gui_gc.py)"


def active_timers() -> list[QTimer]:
    """Every running QTimer made from Python, wherever it lives (parented to the window or not)."""
    gc.collect()
    # issubclass(type(o)) rather than isinstance(): no __class__ lookups on lazy module proxies.
    return [
        o for o in gc.get_objects() if issubclass(type(o), QTimer) and shiboken6.isValid(o) and o.isActive()
    ]


# ---- the local Hub server with a few repos (the model browser's and the first hour's tests) ----
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    folder = tmp_path_factory.mktemp("tiny") / "tiny"
    make_tiny_llama(vocab_size=len(default_tokenizer), seed=7).save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_folder):
    server = HubServer()
    server.add(repo_from_folder(TINY_REPO, tiny_folder, downloads=4200, likes=31))
    server.add(repo_from_folder("kvscope-test/tiny-llama-gated", tiny_folder, gated="manual", downloads=10))
    from engine.model.sources import default_gguf_path

    server.add(
        Repo(
            "kvscope-test/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": default_gguf_path().read_bytes()}
        )
    )
    mamba = {"model_type": "mamba", "architectures": ["MambaForCausalLM"]}
    server.add(
        Repo("kvscope-test/tiny-mamba", {"config.json": json.dumps(mamba).encode(), "model.safetensors": b""})
    )
    server.add(Repo("kvscope-test/docs-only", {"README.md": b"# no weights here\n"}))
    server.start()
    use_hub(monkeypatch, server, tmp_path / "hub")
    yield server
    server.stop()
