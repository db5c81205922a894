"""The context meter under the chat input: how much of the model's context window this
conversation takes (the sent turns, the message being typed, the room kept for the reply, the
reply as it grows), and how full the KV pool is, every figure from the engine.

Two painted bars and a line of text. The controller feeds them: a token count of the
conversation plus the draft while typing (EngineClient.fit_context, on the engine thread), the
reply's tokens while generating, and the pool's used slots from each step's KVStats.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QEvent, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPaintEvent, QPen, QResizeEvent
from PySide6.QtWidgets import QBoxLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.chat.context_fit import refusal
from engine.api import ContextFit
from widgets import theme

BAR_W, BAR_H = 150, 10
# Colours of the context bar's parts: what was sent, what is being typed or generated, the
# room kept for the reply (hatched), and the part over the limit.
SENT, NEW, ROOM, OVER = "#5aa9e6", "#98c379", "#8d95a3", "#ef6b73"
WARN_SHARE = 0.85  # from here the text turns amber


@dataclass(frozen=True, slots=True)
class Segment:
    tokens: int
    colour: str
    hatched: bool = False


class MeterBar(QWidget):
    """Segments laid end to end against a capacity; what exceeds it is drawn red at the end."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setFixedSize(BAR_W, BAR_H)
        self.segments: tuple[Segment, ...] = ()
        self.capacity = 0

    def set_segments(self, segments: tuple[Segment, ...], capacity: int) -> None:
        if (segments, capacity) != (self.segments, self.capacity):
            self.segments, self.capacity = segments, capacity
            self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        painter.fillRect(rect, QColor(theme.SURFACE))
        total = sum(s.tokens for s in self.segments)
        if self.capacity > 0 and total > 0:
            scale = rect.width() / max(self.capacity, total)
            x = rect.left()
            for seg in self.segments:
                w = seg.tokens * scale
                part = QRectF(x, rect.top(), w, rect.height())
                brush = QBrush(
                    QColor(seg.colour),
                    Qt.BrushStyle.BDiagPattern if seg.hatched else Qt.BrushStyle.SolidPattern,
                )
                painter.fillRect(part, brush)
                x += w
            if total > self.capacity:  # the limit, and what is past it
                limit_x = rect.left() + self.capacity * scale
                painter.fillRect(
                    QRectF(limit_x, rect.top(), rect.right() - limit_x, rect.height()), QColor(OVER)
                )
                painter.setPen(QPen(QColor(theme.TEXT), 1.5))
                painter.drawLine(int(limit_x), int(rect.top()), int(limit_x), int(rect.bottom()))
        painter.setPen(QPen(QColor(theme.BORDER), 1.0))
        painter.drawRect(rect)
        painter.end()


class ContextMeter(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("contextMeter")
        self.context_bar = MeterBar()
        self.context_label = QLabel("Context: no model")
        self.context_label.setObjectName("meterText")
        self.pool_bar = MeterBar()
        self.pool_label = QLabel("")
        self.pool_label.setObjectName("meterText")
        # What happens at the limit, on a line of its own under the bars (hidden until then).
        self.note = QLabel("")
        self.note.setObjectName("meterNote")
        self.note.setWordWrap(True)
        self.note.hide()
        # The context and the pool side by side, or one over the other where the chat is too
        # narrow for both on a line (a 1366 px screen): the meter never widens the window.
        self.halves = []
        for bar, label in ((self.context_bar, self.context_label), (self.pool_bar, self.pool_label)):
            half = QHBoxLayout()
            half.setContentsMargins(0, 0, 0, 0)
            half.setSpacing(6)
            half.addWidget(bar)
            half.addWidget(label)
            half.addStretch(1)
            self.halves.append(half)
        self.bars = QBoxLayout(QBoxLayout.Direction.LeftToRight)
        self.bars.setContentsMargins(0, 0, 0, 0)
        self.bars.setSpacing(10)
        for half in self.halves:
            self.bars.addLayout(half)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 0, 2, 0)
        layout.setSpacing(2)
        layout.addLayout(self.bars)
        layout.addWidget(self.note)
        self.fit: ContextFit | None = None
        self.sent_tokens = 0  # of the shown fit: the conversation without the draft
        self.generated = 0

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """As narrow as the wider half: below the two side by side, they stack."""
        hint = super().minimumSizeHint()
        widest = max(half.minimumSize().width() for half in self.halves)
        return QSize(widest + 4, hint.height())

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt's name
        self._arrange(event.size().width())
        super().resizeEvent(event)

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:  # a label's text changed its width
            self._arrange(self.width())
        return super().event(event)

    def _arrange(self, width: int) -> None:
        both = sum(half.sizeHint().width() for half in self.halves) + self.bars.spacing() + 4
        side_by_side = width >= both
        direction = QBoxLayout.Direction.LeftToRight if side_by_side else QBoxLayout.Direction.TopToBottom
        if self.bars.direction() != direction:
            self.bars.setDirection(direction)

    # ---- what the controller sets -------------------------------------------------------------
    def show_fit(self, fit: ContextFit, sent_tokens: int, generated: int = 0) -> None:
        """A measured conversation: `fit.full_tokens` counts everything to be sent, of which
        `sent_tokens` were already in the conversation (the rest is the draft or a branch's
        prefix); `generated` tokens of a reply streaming now."""
        self.fit, self.sent_tokens, self.generated = fit, min(sent_tokens, fit.full_tokens), generated
        self._draw()

    def show_generated(self, generated: int) -> None:
        if self.fit is not None and generated != self.generated:
            self.generated = generated
            self._draw()

    def show_unavailable(self, reason: str) -> None:
        self.fit = None
        self.context_bar.set_segments((), 0)
        self.context_label.setText(f"Context: {reason}")
        self.context_label.setToolTip("")
        self.note.setText("")
        self.note.hide()

    def show_pool(self, used_slots: int, total_slots: int, this_chat: int | None = None) -> None:
        if total_slots <= 0:  # a server that does not say (or nothing loaded)
            self.pool_bar.set_segments((), 0)
            self.pool_label.setText("KV pool: not known")
            return
        segments = (Segment(used_slots, SENT),)
        self.pool_bar.set_segments(segments, total_slots)
        share = used_slots / total_slots if total_slots else 0.0
        self.pool_label.setText(f"KV pool {used_slots:,} / {total_slots:,} slots ({share:.0%})")
        tip = (
            "Token slots of the engine's paged KV pool holding a sequence right now (every chat tab "
            "and the load tool share it); cached blocks of finished replies are free to reuse."
        )
        if this_chat is not None:
            tip += f"\nThis conversation's next request needs {this_chat:,} slots."
        self.pool_label.setToolTip(tip)
        self.pool_bar.setToolTip(tip)

    # ---- drawing ------------------------------------------------------------------------------
    def _draw(self) -> None:
        fit = self.fit
        if fit is None:
            return
        used = fit.prompt_tokens + self.generated
        new = max(0, fit.prompt_tokens - self.sent_tokens) if fit.dropped == 0 else 0
        sent = fit.prompt_tokens - new
        room = max(0, fit.reply_room - self.generated)
        segments = (Segment(sent, SENT), Segment(new + self.generated, NEW), Segment(room, ROOM, True))
        self.context_bar.set_segments(segments, fit.limit)
        share = used / fit.limit if fit.limit else 0.0
        which = "context" if fit.context_window <= fit.pool_tokens else "KV pool's"
        bound = " · pool-bound" if fit.pool_tokens < fit.context_window else ""
        self.context_label.setText(f"Context {used:,} / {fit.limit:,} tokens ({share:.0%}){bound}")
        colour = theme.ERROR if not fit.fits else theme.WARNING if share >= WARN_SHARE or fit.dropped else ""
        self.context_label.setStyleSheet(f"color: {colour};" if colour else "")
        self.context_label.setToolTip(
            f"The model's context window holds {fit.context_window:,} tokens and the KV pool "
            f"{fit.pool_tokens:,}; a request may use the {which} {fit.limit:,}.\n"
            f"Blue: the conversation as it will be sent ({sent:,}); green: the message being "
            f"typed or the reply being generated ({new + self.generated:,}); hatched: room kept "
            f"for the reply ({room:,})."
        )
        self.context_bar.setToolTip(self.context_label.toolTip())
        if not fit.fits:
            self.note.setText(f"⚠ {refusal(fit)}")
            self.note.setStyleSheet(f"color: {theme.ERROR};")
        elif fit.dropped:
            self.note.setText(
                f"At the limit: the oldest {fit.dropped} message{'s' if fit.dropped != 1 else ''} "
                "will be left out of the model's context (marked in the chat)"
            )
            self.note.setStyleSheet(f"color: {theme.WARNING};")
        else:
            self.note.setText("")
        self.note.setVisible(bool(self.note.text()))
