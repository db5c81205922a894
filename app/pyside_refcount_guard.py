"""Guard against a reference-count bug of PySide6 6.12.0 on Python < 3.12.

In PySide6 6.12.0 every `SignalInstance.emit()` from Python returns `True` without taking a
reference to it, and Python slots invoked by Qt drop a reference to `None` now and then. On
Python 3.12+ these singletons are immortal and nothing happens; on 3.11 their counts fall with
every emission (pyqtgraph alone emits dozens of signals per frame) until CPython aborts with
"Fatal Python error: bool_dealloc: deallocating True or False" a minute or two into a session.
Measured here: 100 emits lower sys.getrefcount(True) by exactly 100 under 6.12.0, by 0 under
6.11.3.

The cure is a PySide6 without the bug (pin `PySide6-Essentials<6.12`). Until then, on the
affected combination only, the three singletons get a reference count so large that it cannot
reach zero in any session, which is what Python 3.12 does for them by design (immortal
objects). A static singleton is never freed in any case, so its count has no other meaning.
"""

from __future__ import annotations

import ctypes
import sys

AFFECTED_PYSIDE_VERSIONS = ("6.12.0",)
# 2**40 references: at a million leaked references per second, 12 days to run out.
EXTRA_REFERENCES = 1 << 40


def is_affected(pyside_version: str, python: tuple[int, int] = sys.version_info[:2]) -> bool:
    return pyside_version in AFFECTED_PYSIDE_VERSIONS and python < (3, 12)


def guard_singletons() -> bool:
    """Apply the guard when this interpreter and PySide6 need it; True when applied."""
    import PySide6

    if not is_affected(PySide6.__version__):
        return False
    if getattr(guard_singletons, "applied", False):
        return True
    for singleton in (True, False, None):
        # ob_refcnt is the first field of every CPython object header.
        ctypes.c_ssize_t.from_address(id(singleton)).value += EXTRA_REFERENCES
    guard_singletons.applied = True
    return True
