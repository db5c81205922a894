"""MCP servers: add one (a command started over stdio, or a Streamable HTTP URL), see whether it
started and which tools it offers, reconnect or remove it. The registry does the work
(app.tools.registry); this dialog only shows it and asks."""

from __future__ import annotations

from PySide6.QtCore import Qt, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.tools.mcp_hub import McpServerConfig
from app.tools.registry import ToolRegistry

STATE_WORDS = {"connecting": "starting…", "ready": "ready", "failed": "failed"}


class ServersDialog(QDialog):
    def __init__(self, registry: ToolRegistry, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("MCP servers")
        self.resize(640, 440)
        self.registry = registry
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(["Server / tool", "State", "About"])
        self.tree.setColumnWidth(0, 200)
        self.name = QLineEdit()
        self.name.setPlaceholderText("a name, e.g. files")
        self.kind = QComboBox()
        self.kind.addItem("stdio: a command", "stdio")
        self.kind.addItem("HTTP: a URL", "http")
        self.target = QLineEdit()
        self.kind.currentIndexChanged.connect(self._on_kind)
        self.add_button = QPushButton("Add")
        self.add_button.clicked.connect(self._on_add)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.remove_button = QPushButton("Remove")
        self.remove_button.clicked.connect(self._on_remove)
        self.reconnect_button = QPushButton("Reconnect")
        self.reconnect_button.clicked.connect(self._on_reconnect)
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Kind", self.kind)
        form.addRow("Command / URL", self.target)
        row = QHBoxLayout()
        row.addWidget(self.reconnect_button)
        row.addWidget(self.remove_button)
        row.addStretch(1)
        row.addWidget(self.add_button)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tree, 1)
        layout.addLayout(row)
        layout.addLayout(form)
        layout.addWidget(self.message)
        layout.addWidget(buttons)
        registry.changed.connect(self.refresh)
        self._on_kind()
        self.refresh()

    @Slot()
    def _on_kind(self) -> None:
        stdio = self.kind.currentData() == "stdio"
        self.target.setPlaceholderText("python my_server.py --flag" if stdio else "http://127.0.0.1:8000/mcp")

    def config(self) -> McpServerConfig:
        name, target = self.name.text().strip(), self.target.text().strip()
        if self.kind.currentData() == "stdio":
            return McpServerConfig(name, command=target)
        return McpServerConfig(name, url=target)

    @Slot()
    def _on_add(self) -> None:
        problem = self.registry.add(self.config())
        if problem:
            self.message.setText(f"✗ {problem}")
            self.message.setStyleSheet("color: #ff6b6b;")
            return
        self.message.setText("Starting it: its tools appear when it answers.")
        self.message.setStyleSheet("")
        self.name.clear()
        self.target.clear()

    def _chosen_server(self) -> str | None:
        item = self.tree.currentItem()
        while item is not None and item.parent() is not None:
            item = item.parent()
        return item.data(0, Qt.ItemDataRole.UserRole) if item is not None else None

    @Slot()
    def _on_remove(self) -> None:
        name = self._chosen_server()
        if name:
            self.registry.remove(name)

    @Slot()
    def _on_reconnect(self) -> None:
        name = self._chosen_server()
        if name:
            self.registry.reconnect(name)

    @Slot()
    def refresh(self) -> None:
        self.tree.clear()
        for name, state in self.registry.servers.items():
            where = state.config.command or state.config.url
            item = QTreeWidgetItem([name, STATE_WORDS.get(state.state, state.state), state.message or where])
            item.setData(0, Qt.ItemDataRole.UserRole, name)
            item.setToolTip(2, state.message or where)
            for tool in state.tools:
                QTreeWidgetItem(item, [tool.name, "", tool.description])
            self.tree.addTopLevelItem(item)
            item.setExpanded(True)
        if not self.registry.servers:
            self.message.setText("No MCP servers yet: add one below (a command, or an HTTP URL).")
