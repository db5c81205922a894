"""Helpers for app tests that drive a MainWindow on the tiny model."""

from __future__ import annotations

import threading

LOAD_TIMEOUT_MS = 60_000
REPLY_TIMEOUT_MS = 120_000
# Small enough that the page map stays cheap, large enough for every reply in these tests.
TEST_NUM_BLOCKS = 64
# The local Hub server's tiny chat model (conftest's `hub` fixture): a safetensors repo that loads.
TINY_REPO = "kvscope-test/tiny-llama-chat"
# A gated engine waits at most this long for the test to let it go on.
GATE_TIMEOUT_S = 60.0


def start_tiny(qtbot, window, loaded, config) -> None:
    with qtbot.waitSignal(window.host.model_loaded, timeout=LOAD_TIMEOUT_MS):
        window.start_engine(config, loaded=loaded)


class StepGate:
    """Holds the engine thread after its n-th step until released: a deterministic
    mid-generation moment to look at the window (no sleeps, no timing). With `when`, only the
    steps after which `when()` holds count (on the engine thread): a test of two requests
    counts from the step both run in, however many steps the first took alone before the
    second arrived."""

    def __init__(self, core, after_steps: int, when=None):
        self.reached = threading.Event()
        self.released = threading.Event()
        self._remaining = after_steps
        original = core.step

        def gated_step():
            original()
            if when is not None and not when():
                return
            self._remaining -= 1
            if self._remaining == 0:
                self.reached.set()
                self.released.wait(GATE_TIMEOUT_S)

        core.step = gated_step  # the engine thread looks the method up on every iteration

    def release(self) -> None:
        self.released.set()


def stop_on_first_tokens(window) -> list[int]:
    """Click Stop when the first tokens of a reply reach the window (once); returns the list
    that receives the stopped request's id."""
    stopped: list[int] = []

    def stop(request_id, _events):
        if not stopped:
            stopped.append(request_id)
            window.chat.stop_button.click()

    window.host.tokens_generated.connect(stop)
    return stopped


def wait_started(qtbot, *controllers) -> None:
    """Until each chat controller's reply has started: a send is measured against the context
    on the engine thread first, so `active` is set a frame later."""
    qtbot.waitUntil(lambda: all(c.active is not None for c in controllers), timeout=REPLY_TIMEOUT_MS)
