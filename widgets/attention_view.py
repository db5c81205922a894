"""Every head's attention for the selected token, over the paged cache its step read.

A layer x head grid of small maps: each is one head's weights over the context laid out as the KV
pool holds it, one row per block of the row's block table and one column per slot (so a map is
the blocks the step read, and a sliding window's blocks before it are greyed). Each map is scaled
to its own largest weight; the tooltip gives the numbers. Clicking a map shows that head large,
over the context's tokens, and says which blocks its layer read (the app outlines them in the
page map). It only draws the engine's answer (engine.inside.AttentionMap).
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QEvent, QRect, Qt, Signal
from PySide6.QtGui import QColor, QImage, QMouseEvent, QPainter, QPen
from PySide6.QtWidgets import QLabel, QScrollArea, QSizePolicy, QSplitter, QToolTip, QVBoxLayout, QWidget

from engine.inside import AttentionMap
from widgets import theme
from widgets.heat import heat_rgb
from widgets.token_flow import TokenFlow
from widgets.token_text import escape_html, visible

LABEL_W = 26  # the layer numbers on the left
HEADER_H = 14  # the head numbers on top
GAP = 3
MAX_MAP_ROWS = 24  # a long context's block rows are max-pooled to this many (a spike stays visible)
BEFORE_WINDOW = (58, 62, 70)  # a position the layer's sliding window had left behind
UNUSED_SLOT = (30, 33, 39)  # slots past the query in its last block


def head_map(att: AttentionMap, layer_index: int, head: int) -> np.ndarray:
    """One head's weights as uint8 RGB [block rows, block_size] (a row per block the context
    fills): scaled to its largest weight, before the window greyed, past the query dark."""
    layer, block_size = att.layers[layer_index], att.block_size
    positions, rows = att.query_position + 1, len(att.block_ids)
    values = np.full(rows * block_size, -1.0)
    weights = np.asarray(layer.probs[head], dtype=float)
    top = float(weights.max()) if weights.size else 0.0
    values[layer.start : layer.start + weights.size] = weights / top if top > 0 else weights
    rgb = heat_rgb(np.clip(values, 0.0, 1.0))
    rgb[: layer.start] = BEFORE_WINDOW
    rgb[positions:] = UNUSED_SLOT
    grid = rgb.reshape(rows, block_size, 3)
    if rows > MAX_MAP_ROWS:  # max-pool rows: the brightest of each group (a spike stays visible)
        step = -(-rows // MAX_MAP_ROWS)
        pad = step * MAX_MAP_ROWS - rows
        padded = np.concatenate([grid, np.zeros((pad, block_size, 3), np.uint8)])
        grid = padded.reshape(MAX_MAP_ROWS, step, block_size, 3).max(axis=1)
    return grid


class AttentionGrid(QWidget):
    """The layer x head grid of maps, painted from one image."""

    head_chosen = Signal(int, int)  # layer, head

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.attention: AttentionMap | None = None
        self.chosen: tuple[int, int] | None = None
        self._image: QImage | None = None
        self._cell = (0, 0)
        self.setMouseTracking(True)
        self._font = theme.mono_font(7.5)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)

    def set_attention(self, attention: AttentionMap | None) -> None:
        self.attention = attention
        self.chosen = None
        self._rebuild()

    def _layout(self) -> tuple[int, int, int]:
        """(cell width, cell height, map rows) for the current width."""
        att = self.attention
        assert att is not None
        heads = att.layers[0].heads
        rows = min(MAX_MAP_ROWS, len(att.block_ids))
        width = max(8, (self.width() - LABEL_W) // heads - GAP)
        px = max(1, width // att.block_size)
        return px * att.block_size, max(4, rows * px), rows

    def _rebuild(self) -> None:
        att = self.attention
        self._image = None
        if att is None or not att.layers:
            self.setMinimumHeight(0)
            self.update()
            return
        cell_w, cell_h, _ = self._layout()
        heads, layers = att.layers[0].heads, len(att.layers)
        width = heads * (cell_w + GAP)
        height = layers * (cell_h + GAP)
        canvas = np.empty((height, width, 3), np.uint8)
        canvas[:] = (21, 24, 29)
        for li in range(layers):
            for h in range(heads):
                small = head_map(att, li, h)
                ys = np.linspace(0, small.shape[0], cell_h, endpoint=False).astype(int)
                xs = np.linspace(0, small.shape[1], cell_w, endpoint=False).astype(int)
                y0, x0 = li * (cell_h + GAP), h * (cell_w + GAP)
                canvas[y0 : y0 + cell_h, x0 : x0 + cell_w] = small[ys][:, xs]
        canvas = np.ascontiguousarray(canvas)
        self._image = QImage(canvas.data, width, height, 3 * width, QImage.Format.Format_RGB888).copy()
        self._cell = (cell_w, cell_h)
        self.setMinimumHeight(HEADER_H + height + 2)
        self.update()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        if self.attention is not None:
            self._rebuild()

    def cell_at(self, x: float, y: float) -> tuple[int, int] | None:
        if self._image is None or self.attention is None:
            return None
        cell_w, cell_h = self._cell
        col, row = int((x - LABEL_W) // (cell_w + GAP)), int((y - HEADER_H) // (cell_h + GAP))
        if x < LABEL_W or y < HEADER_H:
            return None
        if 0 <= row < len(self.attention.layers) and 0 <= col < self.attention.layers[0].heads:
            return row, col
        return None

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        att = self.attention
        if att is None or self._image is None:
            painter.end()
            return
        painter.drawImage(LABEL_W, HEADER_H, self._image)
        cell_w, cell_h = self._cell
        painter.setFont(self._font)
        painter.setPen(QColor(theme.MUTED))
        for h in range(att.layers[0].heads):
            painter.drawText(
                QRect(LABEL_W + h * (cell_w + GAP), 0, cell_w, HEADER_H),
                Qt.AlignmentFlag.AlignCenter,
                f"h{h}",
            )
        for li, layer in enumerate(att.layers):
            y = HEADER_H + li * (cell_h + GAP)
            label = f"{layer.layer}" + ("w" if layer.window is not None else "")
            painter.drawText(
                QRect(0, y, LABEL_W - 3, cell_h),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                label,
            )
        if self.chosen is not None:
            li, h = self.chosen
            painter.setPen(QPen(QColor(theme.ACCENT), 2))
            painter.drawRect(
                QRect(
                    LABEL_W + h * (cell_w + GAP) - 1,
                    HEADER_H + li * (cell_h + GAP) - 1,
                    cell_w + 2,
                    cell_h + 2,
                )
            )
        painter.end()

    def choose(self, layer: int, head: int) -> None:
        self.chosen = (layer, head)
        self.update()
        self.head_chosen.emit(layer, head)

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802 - Qt override
        cell = self.cell_at(event.position().x(), event.position().y())
        if cell is not None:
            self.choose(*cell)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip and self.attention is not None:
            cell = self.cell_at(event.pos().x(), event.pos().y())
            if cell is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), describe_head(self.attention, *cell), self)
            return True
        return super().event(event)


def describe_head(att: AttentionMap, layer_index: int, head: int) -> str:
    layer = att.layers[layer_index]
    weights = np.asarray(layer.probs[head])
    top = int(weights.argmax())
    position = layer.start + top
    parts = [
        f"<b>layer {layer.layer}, head {head}</b>: the most weight ({weights[top]:.1%}) on position {position} "
        f"({escape_html(visible(att.token_texts[position]))})",
        f"attends positions {layer.start}–{att.query_position}"
        + (f" (sliding window of {layer.window})" if layer.window is not None else ""),
    ]
    if layer.softcap is not None:
        parts.append(f"logit soft cap {layer.softcap:g}")
    if layer.sinks:
        parts.append(f"its sink took {layer.sink_mass(head):.1%}")
    return "<br>".join(parts)


def head_tokens(flow: TokenFlow, att: AttentionMap, layer_index: int, head: int) -> None:
    """The head's weights over the context's tokens into `flow` (scaled to the largest weight; the
    positions its sliding window left behind grey; the query outlined; a gap per KV block)."""
    layer = att.layers[layer_index]
    weights = layer.probs[head]
    top = max(weights) if weights else 1.0
    values: list[float | None] = []
    tips: list[str] = []
    for position in range(att.query_position + 1):
        offset = position - layer.start
        text = escape_html(visible(att.token_texts[position]))
        block = att.block_ids[position // att.block_size]
        where = f"KV block {block}, slot {position % att.block_size}"
        if offset < 0:
            values.append(None)
            tips.append(f"position {position} ({text}): outside the window · {where}")
        else:
            values.append(weights[offset] / top if top > 0 else 0.0)
            tips.append(f"position {position} ({text}): weight {weights[offset]:.2%} · {where}")
    flow.set_tokens(
        att.token_texts[: att.query_position + 1],
        values,
        tips,
        frozenset({att.query_position}),
        att.block_size,
    )


class AttentionPanel(QWidget):
    """The grid above, the chosen head's tokens below; `blocks_read` tells the app what to outline."""

    blocks_read = Signal(object, str)  # tuple of block ids, what they are

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("attentionPanel")
        self.setStyleSheet(
            f"#attentionPanel, #attentionPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.title = QLabel()
        # what the answer cost: on the engine, and to draw here
        self.cost = QLabel()
        self.cost.setStyleSheet(f"color: {theme.MUTED};")
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.grid = AttentionGrid()
        self.head_title = QLabel()
        self.head_title.setWordWrap(True)
        self.head_title.setTextFormat(Qt.TextFormat.RichText)
        self.tokens = TokenFlow()
        grid_scroll, token_scroll = QScrollArea(), QScrollArea()
        for scroll, inner in ((grid_scroll, self.grid), (token_scroll, self.tokens)):
            scroll.setWidget(inner)
            scroll.setWidgetResizable(True)
            scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        lower = QWidget()
        lower_layout = QVBoxLayout(lower)
        lower_layout.setContentsMargins(0, 0, 0, 0)
        lower_layout.addWidget(self.head_title)
        lower_layout.addWidget(token_scroll, 1)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(grid_scroll)
        split.addWidget(lower)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.title)
        layout.addWidget(self.cost)
        layout.addWidget(split, 1)
        self.grid.head_chosen.connect(self._show_head)
        self.show_message("Pin a token of a reply (click it) to see every head's attention for it.")

    def set_cost(self, text: str) -> None:
        self.cost.setText(text)

    def show_message(self, text: str) -> None:
        self.cost.setText("")
        self.grid.set_attention(None)
        self.tokens.set_tokens((), (), ())
        self.title.setText(f"<span style='color:{theme.MUTED}'>{escape_html(text)}</span>")
        self.head_title.setText("")

    def set_attention(self, attention: AttentionMap, drawn: str) -> None:
        self.grid.set_attention(attention)
        layers, heads = len(attention.layers), attention.layers[0].heads
        query = escape_html(visible(attention.token_texts[attention.query_position]))
        windows = sorted({layer.window for layer in attention.layers if layer.window is not None})
        window_note = (
            f" · layers marked w slide over {', '.join(map(str, windows))} tokens" if windows else ""
        )
        self.title.setText(
            f"Attention of the step that drew <b style='color:{theme.MARK}'>{escape_html(visible(drawn))}</b>: "
            f"query at position {attention.query_position} ({query}) over {attention.query_position + 1} "
            f"positions in {len(attention.block_ids)} KV blocks · {layers} layers × {heads} heads, each map one "
            f"row per block, scaled to its largest weight{window_note} · {escape_html(attention.kernel)}"
        )
        self.grid.choose(layers - 1, 0)

    def _show_head(self, layer_index: int, head: int) -> None:
        att = self.grid.attention
        if att is None:
            return
        head_tokens(self.tokens, att, layer_index, head)
        self.head_title.setText(describe_head(att, layer_index, head).replace("<br>", " · "))
        layer = att.layers[layer_index]
        blocks = att.blocks_read(layer_index)
        note = f"outlined: the {len(blocks)} KV blocks layer {layer.layer} read for the inspected token" + (
            f" (its window of {layer.window})" if layer.window is not None else ""
        )
        self.blocks_read.emit(blocks, note)
