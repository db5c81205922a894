"""The page-map grid: every KV block as a cell, rendered as one image built with numpy.

Painting thousands of cells one QPainter call at a time would hold the GIL for milliseconds per
frame (the engine thread needs it to generate); instead each frame computes a colour per cell in
numpy, expands it to pixels (partial fill, outline and gaps included) and draws one QImage.

Cell look, left to right = token order within the block:
- free: dark; cached-but-free (a reusable prefix): violet;
- in use: the owning sequence's colour over the written part, a dim shade of it over the rest;
- shared (ref count > 1): a white outline, and the count when cells are large enough;
- in use and prefix-cached: a violet corner mark;
- a copy-on-write copy (a fork's own copy of a shared, partly filled block): an amber corner
  mark, top left, while it is in use;
- just written: brightened, fading out over FADE_S.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
from PySide6.QtCore import QEvent, QRect, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from engine.events import BLOCK_OPS
from live.page_map import PageMap
from widgets import theme

MAX_CELL_PX = 40
FADE_S = 0.6  # how long a written block stays brightened
HIGHLIGHT = 0.55  # how far towards white a just-written block starts
EMPTY_SHADE = 0.32  # brightness of a used block's unwritten slots relative to its colour
SHOW_COUNT_PX = 16  # cells at least this large print their ref count when shared
COW_MARK = (240, 180, 41)  # theme.MARK as RGB: the corner of a copy-on-write copy


def grid_for(num_blocks: int, width: int, height: int) -> tuple[int, int, int]:
    """(columns, rows, cell px) of the largest square cells that fit all blocks in the area."""
    if num_blocks <= 0 or width <= 0 or height <= 0:
        return 0, 0, 0
    for cell in range(min(MAX_CELL_PX, width, height), 0, -1):
        cols = width // cell
        rows = math.ceil(num_blocks / cols)
        if rows * cell <= height:
            return cols, rows, cell
    # More blocks than pixels: one pixel each, the rest clipped (the counters still count them).
    return width, height, 1


def _seq_palette(owners: np.ndarray) -> np.ndarray:
    """RGB per block for its first owner (rows for unowned blocks are unused)."""
    colors = np.zeros((len(owners), 3), np.float32)
    for seq in np.unique(owners[owners >= 0]):
        colors[owners == seq] = theme.seq_rgb(int(seq))
    return colors


def cell_colors(pm: PageMap, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block: written-part RGB, unwritten-part RGB (float32, 0..255) and fill fraction."""
    n = pm.num_blocks
    used = pm.ref_count > 0
    cached_free = ~used & pm.cached
    full = np.empty((n, 3), np.float32)
    full[:] = theme.BLOCK_FREE
    full[cached_free] = theme.BLOCK_CACHED_FREE
    seq = _seq_palette(np.where(used, pm.first_owner, -1))
    full[used] = seq[used]
    empty = full.copy()
    empty[used] = seq[used] * EMPTY_SHADE + np.array(theme.BLOCK_FREE, np.float32) * (1 - EMPTY_SHADE)
    glow = np.clip(1.0 - (now - pm.touched_t) / FADE_S, 0.0, 1.0).astype(np.float32) * HIGHLIGHT
    glow[~used] = 0.0
    full += (255.0 - full) * glow[:, None]
    fraction = np.where(used | cached_free, pm.fill / max(1, pm.block_size), 1.0)
    return full, empty, fraction


def render_grid(pm: PageMap, cols: int, rows: int, cell: int, now: float) -> np.ndarray:
    """The grid as an RGB uint8 image of shape (rows * cell, cols * cell, 3)."""
    gap = 1 if cell >= 4 else 0
    inner = cell - gap
    shown = min(pm.num_blocks, cols * rows)
    full, empty, fraction = cell_colors(pm, now)
    full, empty, fraction = full[:shown], empty[:shown], fraction[:shown]

    # Written slots fill the cell from the left; any written slot gets at least one column.
    written_px = np.ceil(fraction * inner).astype(np.int32)
    mask = np.arange(inner)[None, :] < written_px[:, None]  # (shown, inner) columns
    tiles = np.where(mask[:, None, :, None], full[:, None, None, :], empty[:, None, None, :])
    tiles = np.broadcast_to(tiles, (shown, inner, inner, 3)).copy()

    if inner >= 4:
        shared = np.flatnonzero(pm.ref_count[:shown] > 1)
        outline = np.array(theme.BLOCK_OUTLINE_SHARED, np.float32)
        tiles[shared, 0, :] = tiles[shared, -1, :] = outline
        tiles[shared, :, 0] = tiles[shared, :, -1] = outline
    if inner >= 6:
        marked = np.flatnonzero((pm.ref_count[:shown] > 0) & pm.cached[:shown])
        tiles[marked, 1:3, -4:-1] = np.array(theme.BLOCK_CACHED_FREE, np.float32) * 1.6
        copies = np.flatnonzero((pm.ref_count[:shown] > 0) & (pm.copied_from[:shown] >= 0))
        mark = np.array(COW_MARK, np.float32)
        # A small triangle in the top-left corner: rows 1..3, each one pixel shorter.
        tiles[copies, 1, 1:4] = mark
        tiles[copies, 2, 1:3] = mark
        tiles[copies, 3, 1:2] = mark

    padded = np.empty((cols * rows, inner, inner, 3), np.float32)
    padded[:] = theme.BLOCK_GAP
    padded[:shown] = tiles
    image = np.empty((rows, cell, cols, cell, 3), np.uint8)
    image[:] = theme.BLOCK_GAP
    image[:, :inner, :, :inner] = (
        np.clip(padded, 0, 255).reshape(rows, cols, inner, inner, 3).transpose(0, 2, 1, 3, 4)
    )
    return image.reshape(rows * cell, cols * cell, 3)


class KVPageCanvas(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        # paintEvent fills the whole rect first: nothing beneath needs repainting.
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.page_map = PageMap()
        # How a sequence id is named in tooltips (the panel passes the store's group-aware names).
        self.seq_label: Callable[[int], str] = lambda seq_id: f"#{seq_id}"
        self.glow_until = -math.inf  # perf_counter time after which no block is brightened
        # Blocks outlined on the map: the KV blocks an inspected token's step read (the attention view).
        self.highlighted: tuple[int, ...] = ()
        self._image: QImage | None = None
        self._grid = (0, 0, 0)
        self._origin = (0, 0)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(120, 60)
        self.setMouseTracking(True)

    def set_page_map(self, pm: PageMap) -> None:
        self.page_map = pm
        self.rebuild()

    def rebuild(self) -> None:
        now = time.perf_counter()
        pm = self.page_map
        cols, rows, cell = self._grid = grid_for(pm.num_blocks, self.width(), self.height())
        self._image = None
        if cell:
            pixels = np.ascontiguousarray(render_grid(pm, cols, rows, cell, now))
            h, w, _ = pixels.shape
            self._image = QImage(pixels.data, w, h, 3 * w, QImage.Format.Format_RGB888).copy()
            self._origin = ((self.width() - w) // 2, (self.height() - h) // 2)
        in_use = pm.ref_count > 0
        self.glow_until = float(pm.touched_t[in_use].max()) + FADE_S if in_use.any() else -math.inf
        self.update()

    @property
    def blocks_shown(self) -> int:
        cols, rows, _ = self._grid
        return min(self.page_map.num_blocks, cols * rows)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self.rebuild()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        if self._image is None:
            painter.setPen(QColor(theme.MUTED))
            painter.drawText(
                self.rect(), Qt.AlignmentFlag.AlignCenter, "KV pool appears when a model is loaded"
            )
            painter.end()
            return
        ox, oy = self._origin
        painter.drawImage(ox, oy, self._image)
        self._paint_share_counts(painter)
        self._paint_highlight(painter)
        painter.end()

    def set_highlight(self, blocks: tuple[int, ...]) -> None:
        self.highlighted = blocks
        self.update()

    def _paint_highlight(self, painter: QPainter) -> None:
        cols, _, cell = self._grid
        if not self.highlighted or not cell:
            return
        ox, oy = self._origin
        pen = QPen(QColor(theme.MARK))
        pen.setWidth(2 if cell >= 6 else 1)
        painter.setPen(pen)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        for block in self.highlighted:
            if not 0 <= block < self.blocks_shown:
                continue
            row, col = divmod(block, cols)
            painter.drawRect(QRect(ox + col * cell, oy + row * cell, cell - 1, cell - 1))

    def _paint_share_counts(self, painter: QPainter) -> None:
        cols, _, cell = self._grid
        if cell < SHOW_COUNT_PX:
            return
        font = QFont(painter.font())
        font.setPixelSize(max(8, cell // 2))
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(QColor(20, 20, 20))
        ox, oy = self._origin
        for block in np.flatnonzero(self.page_map.ref_count[: self.blocks_shown] > 1):
            row, col = divmod(int(block), cols)
            rect = QRect(ox + col * cell, oy + row * cell, cell - 1, cell - 1)
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, str(int(self.page_map.ref_count[block])))

    # ---- hover -------------------------------------------------------------------------------
    def block_at(self, x: int, y: int) -> int | None:
        cols, rows, cell = self._grid
        if not cell:
            return None
        ox, oy = self._origin
        col, row = (x - ox) // cell, (y - oy) // cell
        if not (0 <= col < cols and 0 <= row < rows):
            return None
        block = row * cols + col
        return block if block < self.blocks_shown else None

    def cell_center(self, block: int) -> tuple[int, int]:
        cols, _, cell = self._grid
        row, col = divmod(block, cols)
        ox, oy = self._origin
        return ox + col * cell + cell // 2, oy + row * cell + cell // 2

    def describe(self, block: int) -> str:
        pm = self.page_map
        refs = int(pm.ref_count[block])
        owners = pm.owners[block]
        if refs > 0:
            who = ", ".join(self.seq_label(s) for s in owners) if owners else "unknown"
            state = f"in use by request {who}" if len(owners) <= 1 else f"shared by requests {who}"
        elif pm.cached[block]:
            state = "free, prefix-cached (reusable without recompute)"
        else:
            state = "free"
        lines = [f"<b>block {block}</b>: {state}"]
        span = pm.token_range(block)
        if span is not None:
            lines.append(
                f"tokens {span[0]}–{span[1] - 1} · {int(pm.fill[block])}/{pm.block_size} slots written"
            )
        lines.append(f"ref count {refs}" + (" · prefix-cached" if refs and pm.cached[block] else ""))
        if refs and pm.copied_from[block] >= 0:
            lines.append(f"copy-on-write copy of block {int(pm.copied_from[block])}")
        if pm.last_op[block] >= 0:
            lines.append(f"last change: {BLOCK_OPS[pm.last_op[block]]}")
        return "<br>".join(lines)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            block = self.block_at(event.pos().x(), event.pos().y())
            if block is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.describe(block), self)
            return True
        return super().event(event)
