"""Scoring a text: paste any text, and see each of its tokens' log-probability under the model
(given the tokens before it), its rank among the vocabulary and its surprise, coloured, with the
text's perplexity. The panel asks (`score_requested`) and draws the engine's answer
(engine.inside.TextScore); the text typed stays as it was, whatever the answer."""

from __future__ import annotations

import math

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.inside import ScoredToken, TextScore
from widgets import theme
from widgets.probability_bars import percent
from widgets.token_flow import TokenFlow
from widgets.token_text import escape_html, visible

# Surprise in bits at which a token's colour saturates: 1 in 2^12 is as surprising as the ramp shows.
SURPRISE_CAP_BITS = 12.0


def token_tip(token: ScoredToken, position: int) -> str:
    text = escape_html(visible(token.text))
    if token.logprob is None:
        return f"position {position} ({text}): the first token, which nothing before it predicts"
    lines = [
        f"position {position} ({text}): log-prob {token.logprob:.3f} (p {percent(math.exp(token.logprob))}), "
        f"rank {token.rank}, surprise {token.surprise_bits:.2f} bits"
    ]
    if token.top is not None:
        lines.append(
            "the model's likeliest here: "
            + " · ".join(
                f"{escape_html(visible(t))} {percent(p)}" for t, p in zip(token.top.texts, token.top.probs)
            )
        )
    return "<br>".join(lines)


class ScorePanel(QWidget):
    score_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("scorePanel")
        self.setStyleSheet(
            f"#scorePanel, #scorePanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText(
            "Paste any text here, then Score: each token's log-probability under the model"
        )
        self.button = QPushButton("Score")
        self.button.clicked.connect(self._ask)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.tokens = TokenFlow()
        scroll = QScrollArea()
        scroll.setWidget(self.tokens)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addWidget(self.input, 1)
        row = QHBoxLayout()
        row.addWidget(self.summary, 1)
        row.addWidget(self.button)
        top_layout.addLayout(row)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(top)
        split.addWidget(scroll)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.addWidget(split, 1)
        self.score: TextScore | None = None
        self.summary.setText(
            f"<span style='color:{theme.MUTED}'>colour: surprise, -log2 p of each token</span>"
        )

    def _ask(self) -> None:
        text = self.input.toPlainText()
        if not text.strip():
            self.show_error("There is no text to score: paste some first.")
            return
        self.button.setEnabled(False)
        self.summary.setText(f"<span style='color:{theme.MUTED}'>scoring on the engine…</span>")
        self.score_requested.emit(text)

    def show_error(self, message: str) -> None:
        self.button.setEnabled(True)
        self.summary.setText(f"<span style='color:{theme.ERROR}'>{escape_html(message)}</span>")

    def show_score(self, score: TextScore, cost: str = "") -> None:
        self.button.setEnabled(True)
        self.score = score
        values: list[float | None] = [
            None if t.surprise_bits is None else min(1.0, t.surprise_bits / SURPRISE_CAP_BITS)
            for t in score.tokens
        ]
        self.tokens.set_tokens(
            [t.text for t in score.tokens], values, [token_tip(t, i) for i, t in enumerate(score.tokens)]
        )
        worst = max(
            (t for t in score.tokens if t.logprob is not None),
            key=lambda t: -(t.logprob or 0.0),
            default=None,
        )
        worst_text = (
            f" · most surprising {escape_html(visible(worst.text))} ({worst.surprise_bits:.1f} bits, rank {worst.rank})"
            if worst is not None
            else ""
        )
        self.summary.setText(
            f"perplexity <b>{score.perplexity:.2f}</b> over the {score.scored} tokens after the first "
            f"(of {len(score.tokens)}; total log-prob {score.total_logprob:.2f} nats){worst_text}{cost}"
        )
