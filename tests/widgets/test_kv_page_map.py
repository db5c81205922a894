"""The page map's cells and counters reflect an exact block state."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hand_events import model_loaded

from engine.events import BlockEvent
from live.state import LiveState
from widgets import theme
from widgets.kv_page_canvas import EMPTY_SHADE, MAX_CELL_PX, grid_for, render_grid
from widgets.kv_page_map import KVPageMapPanel

BLOCK = 4
LONG_AGO = -1e9  # event time far before now: no block is still glowing


def events():
    """Request 1 (6 tokens, block 0 cached) shared by request 2; request 3 came and went."""
    t = LONG_AGO
    return [
        BlockEvent("allocate", (0, 1), 1, t=t),
        BlockEvent("append", (0, 1), 1, 0, 6, (4, 2), t=t),
        BlockEvent("cache", (0,), 1, 0, 4, t=t),
        BlockEvent("share", (0,), 2, 0, 4, (4,), t=t),
        BlockEvent("allocate", (2,), 2, t=t),
        BlockEvent("append", (2,), 2, 4, 5, (1,), t=t),
        BlockEvent("allocate", (3, 4), 3, t=t),
        BlockEvent("append", (3, 4), 3, 0, 8, (4, 4), t=t),
        BlockEvent("cache", (3,), 3, 0, 4, t=t),
        BlockEvent("free", (4, 3), 3, t=t),
    ]


@pytest.fixture
def state():
    state = LiveState()
    state.apply([model_loaded(num_blocks=12, block_size=BLOCK, pool_bytes=12 * 1024)])
    return state


@pytest.fixture
def panel(qtbot, state):
    panel = KVPageMapPanel(state)
    qtbot.addWidget(panel)
    panel.resize(400, 300)
    panel.show()
    qtbot.waitExposed(panel)
    return panel


def pixel(panel, block, dx=0, dy=0, left=False):
    """The canvas colour at a block's centre (moved dx right and dy down), or near its left
    edge with `left` (where the first written slot is drawn)."""
    x, y = panel.canvas.cell_center(block)
    if left:
        dx = 2 - panel.canvas._grid[2] // 2
    color = panel.canvas.grab().toImage().pixelColor(x + dx, y + dy)
    return color.red(), color.green(), color.blue()


def test_cells_show_used_shared_cached_and_free_blocks(panel, state):
    panel.refresh(state.apply(events()))
    assert pixel(panel, 1, left=True) == theme.seq_rgb(1)  # written half of a half-full block
    _, _, cell = panel.canvas._grid
    # Shared block: coloured by its first owner (sampled beside the ref count printed in it).
    assert pixel(panel, 0, dx=-cell // 3, dy=cell // 3) == theme.seq_rgb(1)
    assert pixel(panel, 2, left=True) == theme.seq_rgb(2)
    assert pixel(panel, 3) == theme.BLOCK_CACHED_FREE
    assert pixel(panel, 4) == theme.BLOCK_FREE
    assert pixel(panel, 11) == theme.BLOCK_FREE
    left, top = panel.canvas.cell_center(0)[0] - cell // 2, panel.canvas.cell_center(0)[1] - cell // 2
    edge = panel.canvas.grab().toImage().pixelColor(left, top + cell // 3)
    assert (edge.red(), edge.green(), edge.blue()) == theme.BLOCK_OUTLINE_SHARED


def test_partial_fill_is_drawn(panel, state):
    panel.refresh(state.apply(events()))
    _, _, cell = panel.canvas._grid
    seq = np.array(theme.seq_rgb(1), np.float32)
    dim = tuple(
        np.clip(seq * EMPTY_SHADE + np.array(theme.BLOCK_FREE) * (1 - EMPTY_SHADE), 0, 255).astype(int)
    )
    assert pixel(panel, 1, dx=cell // 3) == dim  # block 1 holds 2 of 4 tokens: right half dim
    assert pixel(panel, 0, dx=cell // 3, dy=cell // 3) == theme.seq_rgb(1)  # block 0 is full


def test_counters_match_the_block_state(panel, state):
    panel.refresh(state.apply(events()))
    text = panel.counters.text()
    assert "<b>3</b> used · 8 free · 1 cached" in text
    assert "1 shared" in text
    assert "slots 7/12 written" in text and "58.3%" in text
    assert "KV 3.0 KiB of 12.0 KiB" in text
    assert "request&nbsp;#1" in panel.legend.text() and "request&nbsp;#3" not in panel.legend.text()


def test_tooltip_names_block_sequences_range_refcount_and_fill(panel, state):
    panel.refresh(state.apply(events()))
    canvas = panel.canvas
    assert canvas.block_at(*canvas.cell_center(2)) == 2
    tip = canvas.describe(0)
    assert "shared by requests #1, #2" in tip and "tokens 0–3" in tip and "4/4 slots" in tip
    assert "ref count 2" in tip and "prefix-cached" in tip
    assert "tokens 4–5" in canvas.describe(1) and "2/4 slots" in canvas.describe(1)
    assert "free, prefix-cached" in canvas.describe(3)
    assert canvas.describe(11).endswith("ref count 0")


def test_blocks_go_dark_when_freed_and_redraw_only_when_dirty(panel, state):
    panel.refresh(state.apply(events()))
    state.apply([BlockEvent("free", (2, 0), 2, t=LONG_AGO)])
    panel.refresh({"memory"})
    assert pixel(panel, 2, left=True) == theme.seq_rgb(2)  # not redrawn: nothing of its changed
    panel.refresh({"kv"})
    assert pixel(panel, 2, left=True) == theme.BLOCK_FREE
    assert pixel(panel, 1, left=True) == theme.seq_rgb(1)
    assert "<b>2</b> used" in panel.counters.text()


def test_freshly_written_blocks_light_up_then_fade(state):
    state.apply(events())
    pm = state.page_map
    cols, rows, cell = grid_for(pm.num_blocks, 120, 40)
    written_at = float(pm.touched_t[2])
    fresh = render_grid(pm, cols, rows, cell, now=written_at)
    later = render_grid(pm, cols, rows, cell, now=written_at + 10.0)
    y, x = cell // 2, 2 * cell + 1
    assert fresh[y, x].sum() > later[y, x].sum()
    assert tuple(later[y, x]) == theme.seq_rgb(2)


@pytest.mark.parametrize(
    "blocks,width,height",
    [(12, 400, 300), (4096, 400, 300), (100_000, 400, 300), (200_000, 400, 300), (1, 50, 50)],
)
def test_grid_fits_every_block_it_can(blocks, width, height):
    cols, rows, cell = grid_for(blocks, width, height)
    assert cols * cell <= width and rows * cell <= height
    if blocks <= width * height:
        assert cols * rows >= blocks
        # Cells are as large as allowed: one pixel more would no longer fit everything.
        bigger = cell + 1
        if cell < MAX_CELL_PX and width // bigger:
            assert math.ceil(blocks / (width // bigger)) * bigger > height
    else:
        assert cell == 1 and (cols, rows) == (width, height)


def test_no_model_yet_says_so(qtbot):
    panel = KVPageMapPanel(LiveState())
    qtbot.addWidget(panel)
    assert "no model loaded" in panel.counters.text()
    assert panel.canvas.block_at(10, 10) is None
