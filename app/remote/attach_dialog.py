"""Remote ▸ Attach to server…: the server's URL and an optional API key, checked before closing."""

from __future__ import annotations

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit, QVBoxLayout, QWidget

from app.remote.target import RemoteTarget, TargetError

EXPLANATION = (
    "An OpenAI-compatible server: vLLM, SGLang, llama.cpp's llama-server, or another kvscope "
    "(<code>kvscope serve</code>). Replies stream from it; its /metrics are graphed; with kvscope "
    "every panel shows the remote engine."
)


class AttachDialog(QDialog):
    def __init__(self, url: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Attach to a server")
        self.target: RemoteTarget | None = None
        self.url = QLineEdit(url)
        self.url.setPlaceholderText("http://127.0.0.1:8000")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional (sent as Authorization: Bearer …)")
        self.error = QLabel()
        self.error.setStyleSheet("color: #e06c75;")
        self.error.setWordWrap(True)
        self.error.hide()
        form = QFormLayout()
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        about = QLabel(EXPLANATION)
        about.setWordWrap(True)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Attach")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(about)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(buttons)
        self.resize(520, self.sizeHint().height())

    def accept(self) -> None:
        try:
            self.target = RemoteTarget.parse(self.url.text(), self.key.text())
        except TargetError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return  # the dialog stays open with what was typed
        super().accept()
