"""Buffers the kernel may back with 2 MiB pages: the weights a decode step streams once a token.

A decode row reads every weight once from memory, through the TLB, whose entries cover 4 KiB
each on small pages. Linux backs an anonymous mapping with 2 MiB pages where it is advised to
(transparent huge pages in "madvise" mode, the common default) before its first touch, but only
whole 2 MiB-aligned pages of it. numpy already advises its large arrays, which start anywhere: a
panel buffer's first and last partial 2 MiB stayed on small pages (1.7B Q4_K_M: 712 MB of its
panels' and other arrays' memory on huge pages, 762 MB with these buffers, the same RSS).
Measured on 2 Zen 5 cores, interleaved in one process: a one-row matmul over 170 MB of
1.7B-shaped Q4_K panels 3.20 -> 2.93 ms; decoding a 1.7B Q4_K_M 23.7 -> 22.9 ms a token, a 1.7B
Q4_0 19.6 -> 19.3. Elsewhere (no madvise, another OS, a small buffer) this is a plain numpy buffer.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

HUGE_PAGE = 2 << 20
# Below this a buffer would be mostly its unaligned ends: not worth a mapping of its own.
SMALLEST = 2 * HUGE_PAGE


def huge_page_buffer(size: int) -> np.ndarray:
    """An uninitialised uint8 buffer of `size` bytes, starting on a 2 MiB boundary and advised to
    be backed by huge pages where the OS takes the advice (Linux); else np.empty."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < SMALLEST or advice is None:
        return np.empty(size, dtype=np.uint8)
    whole_pages = size // HUGE_PAGE * HUGE_PAGE  # the tail stays on small pages: no RSS rounded up
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (a shared mapping is shmem: no anonymous THP)
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)  # zero-filled on first touch
    whole = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    start = -whole.ctypes.data % HUGE_PAGE
    with contextlib.suppress(OSError):  # not taken here (THP off): 4 KiB pages, as np.empty gives
        mapping.madvise(advice, start, whole_pages)
    return whole[start : start + size]
