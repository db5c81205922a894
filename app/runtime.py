"""Process-wide settings for running the engine thread beside a GUI in one Python process.

Both were measured with the app's measure command on the packaged model (2-core machine,
interleaved runs); the figures are beside each setting.
"""

from __future__ import annotations

import os
import sys

# CPython gives the GIL to a waiting thread only after the holder has run this long. The
# default 5 ms is paid at each hand-over between the engine thread (which takes the GIL back
# after every torch op, hundreds of times per token) and the GUI thread (painting, much of it
# Python in pyqtgraph). 0.5 ms: worst GUI stall 0.9-1.05 s -> 0.51-0.54 s and app/headless
# tokens/s 0.56-0.75 -> 0.77-0.80 (machine busy with other work; both runs alike).
GIL_SWITCH_INTERVAL_S = 0.0005


def share_gil_finely() -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def gui_torch_threads(cpu_count: int | None) -> int:
    """torch intra-op threads for the app: every core but one, which the GUI thread (and the
    display server) need. A torch op's threads meet at a barrier, so one of them preempted by
    painting stalls them all: on 2 cores, 1 thread gave the app 7.9-8.3 tokens/s against
    6.4-6.7 with 2, and a lower worst GUI stall (60-68 ms against 85-94 ms), while headless
    speed hardly depends on it (14.6-15.1 against 15.1-15.6 tokens/s)."""
    return max(1, (cpu_count or 1) - 1)


def leave_a_core_for_the_gui() -> int:
    """Apply gui_torch_threads unless the user chose a thread count (OMP_NUM_THREADS)."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(gui_torch_threads(os.cpu_count()))
    return torch.get_num_threads()


def paint_on_the_gui_thread_only() -> None:
    """Qt's raster engine splits large fills and image draws over a thread pool and waits for
    it. Painting from Python (pyqtgraph) holds the GIL through that wait, and on a machine whose
    cores the engine's torch threads keep busy the pool threads start late: a py-spy profile of
    the GUI thread during generation showed ~10% of its samples in QLatch waits under
    drawImage/drawPolygon. Must be set before the QApplication exists; a user's own setting wins."""
    os.environ.setdefault("QT_NO_GUI_THREADPOOL", "1")


def configure_for_gui() -> None:
    """Call once in the GUI process before the QApplication and the engine thread exist."""
    paint_on_the_gui_thread_only()
    share_gil_finely()
    leave_a_core_for_the_gui()
