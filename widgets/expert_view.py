"""Which experts a mixture-of-experts model routed each token to: the load per expert over the
reply (layers x experts, the colour how many of the reply's tokens went there), and each token's
routes (one column per token, one row per MoE layer, the colour its first expert; the selected
token's routes and router weights spelled out). A dense model says it has none. It only draws the
engine's answer (engine.inside.ExpertRoutes)."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QEvent, QRect, Qt
from PySide6.QtGui import QColor, QImage, QPainter, QPen
from PySide6.QtWidgets import QLabel, QScrollArea, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from engine.inside import ExpertRoutes
from widgets import theme
from widgets.heat import heat_rgb
from widgets.token_text import escape_html, visible

LABEL_W = 30
ROW_H = 10
LOAD_CELL = 14
KEY_H = 8  # under the load grid: each expert's colour in the routes below (the key to them)


def expert_rgb(expert: int, experts: int) -> tuple[int, int, int]:
    """A categorical colour per expert (hues around the wheel)."""
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((expert / max(1, experts)) % 1.0, 0.55, 0.92)
    return round(r * 255), round(g * 255), round(b * 255)


class ExpertMaps(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.routes: ExpertRoutes | None = None
        self.selected: int | None = None  # position of the selected token
        self._load: QImage | None = None
        self._tokens: QImage | None = None
        self._col = 4
        self._font = theme.mono_font(7.5)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)

    def set_routes(self, routes: ExpertRoutes | None, selected: int | None) -> None:
        self.routes, self.selected = routes, selected
        self._rebuild()

    def _rebuild(self) -> None:
        routes = self.routes
        self._load = self._tokens = None
        if routes is None:
            self.setMinimumHeight(0)
            self.update()
            return
        load = np.asarray(routes.load, dtype=float)  # [layers, experts]
        top = load.max() if load.size and load.max() > 0 else 1.0
        cell = LOAD_CELL
        big = np.repeat(np.repeat(heat_rgb(load / top), cell, axis=0), cell, axis=1)
        big = np.ascontiguousarray(big)
        h, w, _ = big.shape
        self._load = QImage(big.data, w, h, 3 * w, QImage.Format.Format_RGB888).copy()
        n = len(routes.token_ids)
        self._col = max(2, min(10, (self.width() - LABEL_W - 4) // max(1, n)))
        first = np.array(
            [[row[i].experts[0] for i in range(len(routes.moe_layers))] for row in routes.routes]
        ).T
        palette = np.array([expert_rgb(e, routes.num_experts) for e in range(routes.num_experts)], np.uint8)
        rgb = palette[first]  # [layers, tokens, 3]
        rgb[:, : routes.reply_start] = (rgb[:, : routes.reply_start] * 0.45).astype(
            np.uint8
        )  # the prompt dimmed
        tokens = np.ascontiguousarray(np.repeat(np.repeat(rgb, ROW_H, axis=0), self._col, axis=1))
        h2, w2, _ = tokens.shape
        self._tokens = QImage(tokens.data, w2, h2, 3 * w2, QImage.Format.Format_RGB888).copy()
        self.setMinimumHeight(self._tokens_top() + h2 + 8)
        self.update()

    def _tokens_top(self) -> int:
        return 18 + (self._load.height() if self._load is not None else 0) + KEY_H + 2 + 22

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        if self.routes is not None:
            self._rebuild()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        routes = self.routes
        if routes is None or self._load is None or self._tokens is None:
            painter.end()
            return
        painter.setFont(self._font)
        painter.setPen(QColor(theme.MUTED))
        painter.drawText(
            QRect(LABEL_W, 0, 600, 16),
            Qt.AlignmentFlag.AlignLeft,
            "load over the reply: layer × expert (experts 0… left to right)",
        )
        painter.drawImage(LABEL_W, 18, self._load)
        for i, layer in enumerate(routes.moe_layers):
            y = 18 + i * LOAD_CELL
            painter.drawText(
                QRect(0, y, LABEL_W - 3, LOAD_CELL),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                str(layer),
            )
        key_y = 18 + self._load.height() + 2
        for expert in range(routes.num_experts):
            painter.fillRect(
                QRect(LABEL_W + expert * LOAD_CELL, key_y, LOAD_CELL - 1, KEY_H),
                QColor(*expert_rgb(expert, routes.num_experts)),
            )
        painter.drawText(
            QRect(0, key_y - 3, LABEL_W - 3, KEY_H + 6),
            Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
            "e",
        )
        top = self._tokens_top()
        painter.drawText(
            QRect(LABEL_W, top - 18, 800, 16),
            Qt.AlignmentFlag.AlignLeft,
            "each token's first expert per layer, coloured as the key above (prompt dimmed, then the reply)",
        )
        painter.drawImage(LABEL_W, top, self._tokens)
        if self.selected is not None:
            painter.setPen(QPen(QColor(theme.MARK), 2))
            x = LABEL_W + self.selected * self._col
            painter.drawRect(QRect(x - 1, top - 1, self._col + 1, self._tokens.height() + 1))
        painter.end()

    def token_at(self, x: float, y: float) -> int | None:
        if self.routes is None or self._tokens is None:
            return None
        top = self._tokens_top()
        if not (top <= y < top + self._tokens.height()):
            return None
        position = int((x - LABEL_W) // self._col)
        return position if 0 <= position < len(self.routes.token_ids) else None

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip and self.routes is not None:
            position = self.token_at(event.pos().x(), event.pos().y())
            if position is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), describe_token(self.routes, position), self)
            return True
        return super().event(event)


def describe_token(routes: ExpertRoutes, position: int) -> str:
    text = escape_html(visible(routes.token_texts[position]))
    where = "prompt" if position < routes.reply_start else f"reply token {position - routes.reply_start}"
    lines = [f"<b>{text}</b> (position {position}, {where})"]
    for layer, route in zip(routes.moe_layers, routes.routes[position]):
        chosen = ", ".join(f"expert {e} ({w:.2f})" for e, w in zip(route.experts, route.weights))
        lines.append(f"layer {layer}: {chosen}")
    return "<br>".join(lines)


class ExpertPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("expertPanel")
        self.setStyleSheet(
            f"#expertPanel, #expertPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.title = QLabel()
        # what the answer cost: on the engine, and to draw here
        self.cost = QLabel()
        self.cost.setStyleSheet(f"color: {theme.MUTED};")
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.maps = ExpertMaps()
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setTextFormat(Qt.TextFormat.RichText)
        scroll = QScrollArea()
        scroll.setWidget(self.maps)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.addWidget(self.title)
        layout.addWidget(self.cost)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.detail)
        self.show_message("Pin a token of a reply (click it) to see which experts its tokens were routed to.")

    def set_cost(self, text: str) -> None:
        self.cost.setText(text)

    def show_message(self, text: str) -> None:
        self.cost.setText("")
        self.maps.set_routes(None, None)
        self.title.setText(f"<span style='color:{theme.MUTED}'>{escape_html(text)}</span>")
        self.detail.setText("")

    def set_routes(self, routes: ExpertRoutes, selected: int | None) -> None:
        self.maps.set_routes(routes, selected)
        reply = len(routes.token_ids) - routes.reply_start
        self.title.setText(
            f"Expert routes: {routes.num_experts} experts, top {routes.top_k} per token, in "
            f"{len(routes.moe_layers)} MoE layers · {len(routes.token_ids)} tokens ({reply} in the reply) "
            "· the routers' own choices"
        )
        self.detail.setText(describe_token(routes, selected) if selected is not None else "")
