"""The beams of a running (or finished) beam search as a tree, drawn from the store's BeamSteps.

One column per step, one node per beam slot: the token the slot chose and its running score
(the sum of its tokens' log-probs). An edge joins each node to the slot of the previous step it
extends (step 0 extends the prompt). Branches the search dropped fade; hypotheses that finished
at a step hang below that step's slots with an amber border and their length-penalised score.
A slot's border has the colour of the sequence holding it, as its blocks in the page map.
The view only reads `LiveState.groups[request].beam_steps`; it redraws when a step arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from engine.events import BeamStep
from live.state import LiveState
from widgets import theme

COLUMN_PX = 92  # one step
ROW_PX = 36  # one slot
NODE_W = 80
NODE_H = 30
MARGIN = 6
ROOT_W = 52  # the prompt node at the left
# Beam scores at or below this are the search's "no candidate" sentinel (transformers masks
# finished slots with about -1e9), not a probability: shown as a dash.
NO_SCORE = -1e8


@dataclass(frozen=True, slots=True)
class BeamNode:
    """One drawn node: a slot of a step, or a hypothesis that finished at that step."""

    step: int
    row: int  # the slot (0..k-1), or k + i for the i-th finished hypothesis of the step
    parent_row: int  # the slot of step - 1 it extends (-1: the prompt)
    text: str
    score: float
    finished: bool
    alive: bool  # on a path to the current beams or to a finished hypothesis
    seq_id: int = -1  # the engine sequence holding the slot (its colour in the page map)


def format_score(score: float) -> str:
    return "–" if score <= NO_SCORE or math.isnan(score) else f"{score:.2f}"


def token_label(text: str) -> str:
    """A token's text made visible: newlines and leading/trailing spaces shown as marks."""
    shown = text.replace("\n", "⏎").replace("\t", "⇥")
    if shown.startswith(" "):
        shown = "·" + shown[1:]
    return shown or "∅"


def beam_nodes(steps: list[BeamStep]) -> list[BeamNode]:
    """Every node of the tree, step by step; `alive` marks the paths still leading somewhere."""
    if not steps:
        return []
    k = len(steps[0].token_ids)
    # A finished hypothesis names only its last token's id; the same id chosen by a slot at any
    # step tells its text (else the id is shown).
    known = {tid: text for step in steps for tid, text in zip(step.token_ids, step.token_texts)}
    # Walk back from the last step: a slot is alive when a later alive slot (or a finished
    # hypothesis) extends it. When the search is done, the last step's slots that hold no
    # candidate (the no-score sentinel) lead nowhere.
    last = steps[-1]
    alive: list[set[int]] = [set() for _ in steps]
    alive[-1] = {j for j, score in enumerate(last.scores) if not (last.done and score <= NO_SCORE)}
    for s in range(len(steps) - 1, 0, -1):
        alive[s - 1] = {steps[s].parents[j] for j in alive[s]} | {f.parent for f in steps[s].finished}
    nodes = []
    for s, step in enumerate(steps):
        slots = zip(step.parents, step.token_texts, step.scores, step.seq_ids)
        for slot, (parent, text, score, seq_id) in enumerate(slots):
            nodes.append(BeamNode(s, slot, parent if s else -1, text, score, False, slot in alive[s], seq_id))
        for i, fin in enumerate(step.finished):
            parent = fin.parent if s else -1
            text = known.get(fin.token_id, f"id {fin.token_id}")
            nodes.append(BeamNode(s, k + i, parent, text, fin.score, True, True))
    return nodes


class BeamTreeView(QWidget):
    def __init__(self, state: LiveState, request_id: int | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.state = state
        self.request_id = request_id
        self.nodes: list[BeamNode] = []
        self._steps_drawn = -1
        self.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)
        self._font = QFont(self.font())
        self._font.setPointSizeF(8.5)
        self.refresh()

    def set_request(self, request_id: int | None) -> None:
        self.request_id = request_id
        self._steps_drawn = -1
        self.refresh()

    def steps(self) -> list[BeamStep]:
        group = self.state.groups.get(self.request_id) if self.request_id is not None else None
        return group.beam_steps if group is not None else []

    def refresh(self, dirty: set[str] | None = None) -> None:
        """Rebuild when new steps arrived (cheap otherwise: a length check)."""
        steps = self.steps()
        if len(steps) == self._steps_drawn:
            return
        self._steps_drawn = len(steps)
        self.nodes = beam_nodes(steps)
        rows = max((n.row for n in self.nodes), default=0) + 1
        width = MARGIN * 2 + ROOT_W + COLUMN_PX * max(1, len(steps))
        self.setFixedSize(width, MARGIN * 2 + ROW_PX * rows)
        self.update()

    # ---- geometry --------------------------------------------------------------------------
    def node_rect(self, step: int, row: int) -> QRectF:
        x = MARGIN + ROOT_W + COLUMN_PX * step + (COLUMN_PX - NODE_W)
        y = MARGIN + ROW_PX * row + (ROW_PX - NODE_H) / 2
        return QRectF(x, y, NODE_W, NODE_H)

    def root_rect(self) -> QRectF:
        return QRectF(MARGIN, MARGIN + (ROW_PX - NODE_H) / 2, ROOT_W - 8, NODE_H)

    def node_at(self, x: float, y: float) -> BeamNode | None:
        return next((n for n in self.nodes if self.node_rect(n.step, n.row).contains(QPointF(x, y))), None)

    # ---- painting --------------------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        painter.setFont(self._font)
        visible = QRectF(event.rect()).adjusted(-COLUMN_PX, 0, COLUMN_PX, 0)
        root = self.root_rect()
        painter.setPen(QColor(theme.MUTED))
        painter.drawRoundedRect(root, 4, 4)
        painter.drawText(root, Qt.AlignmentFlag.AlignCenter, "prompt")
        for node in self.nodes:
            rect = self.node_rect(node.step, node.row)
            if not rect.intersects(visible):
                continue
            self._paint_edge(painter, node, rect)
        for node in self.nodes:
            rect = self.node_rect(node.step, node.row)
            if rect.intersects(visible):
                self._paint_node(painter, node, rect)
        painter.end()

    def _paint_edge(self, painter: QPainter, node: BeamNode, rect: QRectF) -> None:
        start = self.root_rect() if node.parent_row < 0 else self.node_rect(node.step - 1, node.parent_row)
        colour = QColor(theme.TEXT if node.alive else theme.GRID)
        painter.setPen(QPen(colour, 1.4 if node.alive else 1.0))
        painter.drawLine(QPointF(start.right(), start.center().y()), QPointF(rect.left(), rect.center().y()))

    def _paint_node(self, painter: QPainter, node: BeamNode, rect: QRectF) -> None:
        if node.finished:
            border, fill, text = QColor(theme.MARK), QColor(60, 50, 20), QColor(theme.TEXT)
        elif node.alive:
            border, fill, text = (
                QColor(*theme.seq_rgb(node.seq_id)),
                QColor(36, 40, 48),
                QColor(theme.TEXT),
            )
        else:
            border, fill, text = QColor(theme.GRID), QColor(28, 30, 36), QColor(theme.MUTED)
        painter.setPen(QPen(border, 1.2))
        painter.setBrush(fill)
        painter.drawRoundedRect(rect, 4, 4)
        painter.setPen(text)
        top = QRectF(rect.left() + 3, rect.top() + 1, rect.width() - 6, rect.height() / 2)
        bottom = QRectF(rect.left() + 3, rect.center().y(), rect.width() - 6, rect.height() / 2 - 1)
        label = painter.fontMetrics().elidedText(
            token_label(node.text), Qt.TextElideMode.ElideRight, int(top.width())
        )
        painter.drawText(top, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, label)
        painter.setPen(QColor(theme.MUTED))
        painter.drawText(
            bottom, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, format_score(node.score)
        )

    # ---- hover -----------------------------------------------------------------------------
    def describe(self, node: BeamNode) -> str:
        where = "the prompt" if node.parent_row < 0 else f"beam {node.parent_row + 1} of step {node.step}"
        if node.finished:
            head = f"a hypothesis ended at step {node.step + 1} with {token_label(node.text)!r}"
            score = f"score {format_score(node.score)} (length-penalised)"
        else:
            head = f"step {node.step + 1}, beam {node.row + 1}: {token_label(node.text)!r}"
            score = f"running score {format_score(node.score)} (sum of log p)"
        fate = "" if node.alive else "<br>dropped by the search"
        return f"<b>{head}</b><br>extends {where}<br>{score}{fate}"

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            node = self.node_at(event.pos().x(), event.pos().y())
            if node is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.describe(node), self)
            return True
        return super().event(event)
