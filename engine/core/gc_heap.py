"""The Python heap an engine's load leaves behind, kept out of the garbage collector's way.

Once a model is loaded the process tracks ~375,000 objects that live as long as the engine:
torch's and transformers' modules, the tokenizer's vocabulary, the engine's tables. Python's full
collection walks every one of them, holding the GIL: 185-200 ms measured here (the packaged model
and a 1.7B GGUF alike), one token's wait during a reply in the headless engine and a frozen window
in the app, whenever the objects made since the last one pass a quarter of those. `gc.freeze()`
moves them to the permanent generation, which collections skip (vLLM freezes its start-up heap
the same way); objects made later are collected as before.

No collection before freezing: the engine thread must not collect, a collection may finalize the
app's Qt objects, which only its GUI thread may (app/window.py release_engine). A load leaves
next to no garbage (0-10 unreachable objects, measured); what it leaves waits for the thaw, when
the engine closes, and the app collects right after.

Engine code that must see a model's memory back at once (a measurement that loads a second copy)
calls `collect()`, never `gc.collect()`: in the app the collection then runs on the GUI thread
(app/gui_gc.py installs the collector), elsewhere here.
"""

from __future__ import annotations

import gc
from collections.abc import Callable


def _collect_here() -> None:
    gc.collect()


_collector: list[Callable[[], None]] = [_collect_here]


def collect() -> None:
    """A full collection, wherever the process allows one (see the module's docstring)."""
    _collector[0]()


def set_collector(collector: Callable[[], None] | None) -> None:
    """Where `collect()` collects from now on; None: on the calling thread again."""
    _collector[0] = collector or _collect_here


def freeze() -> None:
    """Keep every object alive now out of collections."""
    gc.freeze()


def thaw() -> None:
    """The engine is closing: its objects are collectable again (all frozen objects, of every
    engine in the process: the next load freezes the survivors again)."""
    gc.unfreeze()
