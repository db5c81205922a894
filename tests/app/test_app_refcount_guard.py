"""The guard keeps the app alive on PySide6 6.12.0 + Python 3.11 (a refcount bug in emit())."""

from __future__ import annotations

import subprocess
import sys

import PySide6
import pytest

from app.pyside_refcount_guard import is_affected

# Far more emits than True's reference count (a few hundred at start-up): without the guard the
# affected combination aborts long before the end.
EMIT_SCRIPT = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QObject, Signal
from app.pyside_refcount_guard import guard_singletons
if sys.argv[1] == "guarded":
    guard_singletons()
class Emitter(QObject):
    fired = Signal()
emitter = Emitter()
for _ in range(20_000):
    emitter.fired.emit()
print("survived")
"""


def run_emitter(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", EMIT_SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(_root()),
    )


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def test_affected_combinations():
    assert is_affected("6.12.0", (3, 11))
    assert not is_affected("6.12.0", (3, 12))  # immortal singletons: nothing to guard
    assert not is_affected("6.11.3", (3, 11))


def test_many_emits_survive_with_the_guard():
    result = run_emitter("guarded")
    assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-2000:]


@pytest.mark.skipif(not is_affected(PySide6.__version__), reason="this PySide6/Python has no refcount bug")
def test_without_the_guard_the_bug_aborts_the_interpreter():
    """The control: proves the test above exercises the bug rather than passing trivially."""
    result = run_emitter("unguarded")
    assert result.returncode != 0 and "deallocating True or False" in result.stderr
