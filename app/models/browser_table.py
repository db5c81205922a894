"""Read-only result tables of the model browser (one look for the Hub's and the cache's)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem


def item(text: str, sort_value=None, tip: str = "") -> QTableWidgetItem:
    cell = QTableWidgetItem(text)
    cell.setFlags(cell.flags() & ~Qt.ItemFlag.ItemIsEditable)
    if sort_value is not None:
        cell.setData(Qt.ItemDataRole.UserRole, sort_value)
    if tip:
        cell.setToolTip(tip)
    return cell


def table(columns: tuple[str, ...]) -> QTableWidget:
    """Rows selected whole, one at a time; the first column takes the spare width."""
    view = QTableWidget(0, len(columns))
    view.setHorizontalHeaderLabels(list(columns))
    view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    view.verticalHeader().setVisible(False)
    view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    view.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    return view
