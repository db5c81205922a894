"""The logit-bias and banned-token editors of the sampling controls: typed as text, resolved to
the model's tokens by the engine (app.token_entries through Engine.call) and shown as tokens
under each field. Until a model can tokenize them, entries given as #id still apply and text
entries wait (the line under the field says so); what was typed is kept either way."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal, Slot
from PySide6.QtWidgets import QLabel, QLineEdit

from app.token_entries import (
    EntryError,
    ResolvedEntry,
    TokenEntry,
    banned_ids,
    bias_pairs,
    describe,
    parse_banned,
    parse_bias,
)
from widgets import theme

RESOLVE_DELAY_MS = 300  # after typing pauses
# resolver(entries, on_result(list[ResolvedEntry]), on_error(message)) -> False when no model
Resolver = Callable[[list[TokenEntry], Callable, Callable[[str], None]], bool]


def ids_as_text(pairs: tuple[tuple[int, float], ...] = (), ids: tuple[int, ...] = ()) -> tuple[str, str]:
    """Settings that came as token ids alone (an older save, the CLI): shown as #id entries."""
    return " | ".join(f"#{t}={b:g}" for t, b in pairs), " | ".join(f"#{t}" for t in ids)


class TokenTextEditors(QObject):
    changed = Signal()  # the resolved bias or bans changed

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.bias = QLineEdit()
        self.bias.setPlaceholderText('none   (e.g.  Paris=5 | " Rome"=-3 | #1234=-100)')
        self.banned = QLineEdit()
        self.banned.setPlaceholderText('none   (e.g.  sorry | " As an AI" | #1234)')
        self.bias_tokens = QLabel("")
        self.banned_tokens = QLabel("")
        for label in (self.bias_tokens, self.banned_tokens):
            label.setObjectName("hint")
            label.setWordWrap(True)
            label.hide()
        self.resolver: Resolver | None = None
        self.logit_bias: tuple[tuple[int, float], ...] = ()
        self.banned_token_ids: tuple[int, ...] = ()
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(RESOLVE_DELAY_MS)
        self._timer.timeout.connect(self.resolve_now)
        # (not textEdited -> QTimer.start directly: the text would be taken for the interval)
        self.bias.textEdited.connect(lambda _text: self._timer.start())
        self.banned.textEdited.connect(lambda _text: self._timer.start())
        self._asked = 0  # numbers the resolutions: only the latest one's answer is used

    # ---- values ------------------------------------------------------------------------------
    def texts(self) -> dict[str, str]:
        return {"logit_bias": self.bias.text(), "banned": self.banned.text()}

    def set_texts(self, texts: dict | None, logit_bias=(), banned=()) -> None:
        """Show `texts` (or the ids as #id entries) with these resolved ids, without emitting;
        they are tokenized again when a model is there (`resolve_now`)."""
        if not texts:
            texts = dict(zip(("logit_bias", "banned"), ids_as_text(tuple(logit_bias), tuple(banned))))
        self.bias.setText(str(texts.get("logit_bias", "")))
        self.banned.setText(str(texts.get("banned", "")))
        self.logit_bias, self.banned_token_ids = tuple(logit_bias), tuple(banned)
        self._show(self.bias_tokens, "", "")
        self._show(self.banned_tokens, "", "")

    # ---- resolving -----------------------------------------------------------------------------
    @Slot()
    def resolve_now(self) -> None:
        self._asked += 1
        asked = self._asked
        for field, parse, label, apply in (
            (self.bias, parse_bias, self.bias_tokens, self._apply_bias),
            (self.banned, parse_banned, self.banned_tokens, self._apply_banned),
        ):
            try:
                entries = parse(field.text())
            except EntryError as exc:
                self._show(label, str(exc), theme.ERROR)
                continue
            if not entries:
                self._show(label, "", "")
                apply([])
                continue
            self._resolve(entries, label, apply, asked)

    def _resolve(self, entries: list[TokenEntry], label: QLabel, apply, asked: int) -> None:
        def done(resolved: list[ResolvedEntry]) -> None:
            if asked == self._asked:
                self._show(label, describe(resolved), "")
                apply(resolved)

        def no_model(message: str) -> None:
            if all(e.token_id is not None for e in entries):  # ids need no tokenizer
                done([ResolvedEntry(e, (e.token_id,), (f"#{e.token_id}",)) for e in entries])
            else:
                self._show(
                    label, f"not applied yet: {message} (text is tokenized by the model)", theme.WARNING
                )

        def failed(message: str) -> None:
            if asked == self._asked:
                self._show(label, message, theme.ERROR)

        # The resolver answers False (after calling on_error) when no model can tokenize now.
        if self.resolver is None or not self.resolver(entries, done, failed):
            no_model("no model is loaded")

    def _apply_bias(self, resolved: list[ResolvedEntry]) -> None:
        pairs = bias_pairs(resolved)
        if pairs != self.logit_bias:
            self.logit_bias = pairs
            self.changed.emit()

    def _apply_banned(self, resolved: list[ResolvedEntry]) -> None:
        ids = banned_ids(resolved)
        if ids != self.banned_token_ids:
            self.banned_token_ids = ids
            self.changed.emit()

    @staticmethod
    def _show(label: QLabel, text: str, colour: str) -> None:
        label.setText(text)
        label.setStyleSheet(f"color: {colour};" if colour else "")
        label.setVisible(bool(text))
