"""Panel buffers start on a 2 MiB boundary and take huge pages where Linux gives them."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from engine.kernels import huge_pages
from engine.kernels.huge_pages import HUGE_PAGE, SMALLEST, huge_page_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages ("always", "madvise", "never"), or None."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def huge_kib_of(buffer: np.ndarray) -> int:
    """AnonHugePages of the mapping that holds `buffer` (/proc/self/smaps)."""
    address, lines = buffer.ctypes.data, Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            if low <= address < high:
                for field in lines[i + 1 :]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1])
    raise AssertionError("no mapping holds the buffer")


def test_a_large_buffer_starts_on_a_huge_page_and_holds_what_is_written():
    size = SMALLEST + 12345
    buffer = huge_page_buffer(size)
    assert buffer.dtype == np.uint8 and buffer.nbytes == size and buffer.flags.writeable
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buffer.ctypes.data % HUGE_PAGE == 0
    buffer[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    assert buffer[-1] == (size - 1) % 256 and buffer[HUGE_PAGE] == HUGE_PAGE % 256


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_linux_backs_its_whole_2_mib_pages_with_huge_pages():
    buffer = huge_page_buffer(3 * HUGE_PAGE + 4096)
    buffer[:] = 1  # the first touch, after the advice
    huge = huge_kib_of(buffer)
    # the whole pages, none of the tail (defragmentation may leave one out on a busy machine)
    assert 2 * HUGE_PAGE // 1024 <= huge <= 3 * HUGE_PAGE // 1024


def test_a_small_buffer_is_a_plain_array(monkeypatch):
    monkeypatch.setattr(huge_pages, "SMALLEST", 1 << 40)
    buffer = huge_page_buffer(4 * HUGE_PAGE)
    assert buffer.base is None  # numpy's own memory, no mapping of its own
