"""The window's remote parts: the Remote menu, the Remote metrics dock, and what the panels say
when the attached server does not expose what they draw.

A kvscope server streams its engine's events, so every panel works as with a local engine. Any
other OpenAI-compatible server reports replies, logprobs and /metrics only: the page map, the
roofline, memory and the step timeline are then covered by a notice saying plainly what the
remote engine does not expose (and where its metrics are), instead of an empty or stale graph.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, Slot
from PySide6.QtWidgets import QDockWidget, QLabel, QMenu, QMenuBar, QVBoxLayout, QWidget

from app.chat.controller import ChatController
from app.remote.attach_dialog import AttachDialog
from app.remote.host import AttachableHost
from app.remote.metrics_panel import RemoteMetricsPanel
from app.remote.target import RemoteSource, RemoteTarget
from app.remote.vllm_kv import PrefixCacheState
from app.settings import AppSettings
from app.status_bar import StatusBar
from widgets import theme
from widgets.sweep_panel import SweepPanel

URL_SETTING = "remote/url"


def prefix_cache_line(source: RemoteSource, state: PrefixCacheState | None) -> str:
    """vLLM only: its prefix-cache blocks, as its ZMQ KV-cache events tell them."""
    if source.family != "vllm" or state is None:
        return ""
    if not state.batches:
        return (
            f"<br>Listening for its ZMQ KV-cache events at <code>{state.endpoint}</code>: none yet. vLLM "
            'publishes them when started with <code>--kv-events-config \'{"enable_kv_cache_events": true, '
            '"publisher": "zmq"}\'</code>, and a block only once it fills (its CPU backend\'s blocks hold '
            "128 tokens, so a short chat stores none)."
        )
    size = f" of {state.block_size} tokens" if state.block_size else ""
    return (
        f"<br><b>Its prefix cache</b>, from its ZMQ KV-cache events at <code>{state.endpoint}</code>: "
        f"<b>{state.blocks}</b> blocks{size} cached ({state.tokens:,} tokens); {state.stored} stored, "
        f"{state.removed} evicted, {state.cleared} clears since this app subscribed. The events name "
        "blocks by content hash, not by their place in the pool."
    )


def notices(source: RemoteSource, kv_now: str, prefix: str = "") -> dict[str, str]:
    """What each panel says for a server that streams no engine events."""
    s = f"{source.server_name} at {source.target.label}"
    serve = "Attached to <code>kvscope serve</code>, this panel shows the remote engine as if it were local."
    return {
        "page_map": (
            f"<b>KV-cache pages: not exposed by {s}.</b><br>An OpenAI-compatible API reports no KV blocks, "
            "so there is no page map to draw. What the server does export, its KV-cache usage"
            f"{kv_now}, is graphed in <i>Remote metrics</i>.{prefix}<br>{serve}"
        ),
        "roofline": (
            f"<b>Roofline: not available for {s}.</b><br>A roofline places each engine step's FLOPs and "
            "bytes under the device's measured limits. A remote server reports neither its steps (their "
            "tokens, context and time) nor its device, so nothing drawn here would be a measurement.<br>"
            f"{serve}"
        ),
        "memory": (
            f"<b>Memory: not exposed by {s}.</b><br>Its memory by source (weights, KV pool, process) is "
            f"not in its API; its KV-cache usage{kv_now} is in <i>Remote metrics</i>.<br>{serve}"
        ),
        "step_timeline": (
            f"<b>Engine steps: not exposed by {s}.</b><br>It does not stream its scheduler's steps "
            "(prefill and decode tokens per step); its throughput and queue are in <i>Remote metrics</i>."
            f"<br>{serve}"
        ),
    }


class Covered(QWidget):
    """A panel with a notice that can take its place."""

    def __init__(self, panel: QWidget, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.panel = panel
        self.notice = QLabel()
        self.notice.setObjectName("remoteNotice")
        self.notice.setTextFormat(Qt.TextFormat.RichText)
        self.notice.setWordWrap(True)
        self.notice.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.notice.setStyleSheet(f"background: {theme.BACKGROUND}; color: {theme.TEXT}; padding: 10px;")
        self.notice.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.notice, 1)
        layout.addWidget(panel, 1)

    def cover(self, text: str | None) -> None:
        if text:
            self.notice.setText(text)
        self.notice.setVisible(bool(text))
        self.panel.setVisible(not text)

    @property
    def covered(self) -> bool:
        return not self.notice.isHidden()


class RemoteViews(QObject):
    """Given what it works through: the window only as the parent of its dialog, the attachable
    host, the docks it covers and a way to add its own, the menu bar, the settings (the last URL),
    the chat (stopped and synced around an attach; its banner offers Reattach when a server goes
    away mid-reply), the status bar, the sweep panel (no local sweep of a remote model), and the
    window's status refresh and detach."""

    COVERED = ("page_map", "roofline", "memory", "step_timeline")

    def __init__(
        self,
        dialogs: QWidget,
        host: AttachableHost,
        docks: dict[str, QDockWidget],
        add_dock: Callable[[str, str, QWidget], QDockWidget],
        menu_bar: QMenuBar,
        settings: AppSettings,
        chat: ChatController,
        status: StatusBar,
        sweep: SweepPanel,
        refresh_status: Callable[[], None],
        detach: Callable[[], None],
    ) -> None:
        super().__init__(dialogs)
        self.dialogs, self.host, self.settings, self.chat, self.status = dialogs, host, settings, chat, status
        self.sweep, self._refresh_status, self._detach = sweep, refresh_status, detach
        self.covers: dict[str, Covered] = {}
        for key in self.COVERED:
            dock = docks[key]
            cover = Covered(dock.widget())
            dock.setWidget(cover)
            self.covers[key] = cover
        self.panel = RemoteMetricsPanel(self.host)
        dock = add_dock("remote_metrics", "Remote metrics", self.panel)
        dock.hide()
        self.dock: QDockWidget = dock
        self._build_menu(menu_bar)
        self.host.source_changed.connect(self._on_source_changed)
        self.host.metrics_changed.connect(self._refresh_notices)
        self.host.model_loaded.connect(self._on_model_loaded)
        self.host.model_load_failed.connect(self._on_load_failed)
        self.host.request_failed.connect(self._on_request_failed)

    def _build_menu(self, bar: QMenuBar) -> None:
        menu = QMenu("&Remote", bar)
        bar.insertMenu(bar.actions()[-1], menu)  # before Help, which stays last
        self.menu = menu
        self.attach_action = menu.addAction("&Attach to server…")
        self.attach_action.triggered.connect(self.ask_and_attach)
        self.detach_action = menu.addAction("&Detach (back to the local model)")
        self.detach_action.triggered.connect(self.detach)
        self.detach_action.setEnabled(False)
        menu.addSeparator()
        menu.addAction(self.dock.toggleViewAction())

    # ---- attaching -------------------------------------------------------------------------
    @Slot()
    def ask_and_attach(self) -> None:
        dialog = AttachDialog(self.settings.get(URL_SETTING, "") or "", self.dialogs)
        if dialog.exec() and dialog.target is not None:
            self.attach(dialog.target)

    def attach(self, target: RemoteTarget, use_events: bool = True) -> None:
        if self.chat.active is not None:
            self.chat.stop()
        self.settings.set(URL_SETTING, target.url)  # never the key
        self.host.attach(target, use_events=use_events)
        self.detach_action.setEnabled(True)
        self.status.showMessage(f"Attaching to {target.url}…", 5000)
        self.chat.sync_state()
        self._refresh_status()

    @Slot()
    def detach(self) -> None:
        """Back to the local engine, on the model chosen in the Controls panel."""
        self._detach()

    @Slot(object)
    def _on_request_failed(self, event: object) -> None:
        """A remote engine that stopped answering mid-reply (its connection or its events stream
        broke): the chat kept the partial reply, marked failed; offer to attach again."""
        target = self.host.target
        message = getattr(event, "message", "")
        if not self.host.attached or target is None or not _is_connection_loss(message):
            return
        self.chat.pane.banner.show_message(
            f"{target.label} stopped answering mid-reply ({message}). The partial reply is kept, "
            "marked failed; Continue or Regenerate it once the server is back.",
            "Reattach",
            lambda: self.attach(target),
        )

    # ---- following the source --------------------------------------------------------------
    @Slot(object)
    def _on_source_changed(self, source: RemoteSource | None) -> None:
        self.detach_action.setEnabled(self.host.attached)
        if source is not None:
            self.dock.show()
            self.dock.raise_()
            if not source.events:
                self.chat.forget_token_data()
                self.chat.pane.input.setPlaceholderText(
                    f"Message {source.display_name}…  (Enter sends, Shift+Enter for a new line)"
                )
        self._refresh_notices()
        self._refresh_status()

    @Slot()
    def _refresh_notices(self) -> None:
        source = self.host.remote
        texts = {}
        if source is not None and not source.events:
            point = self.host.metrics[-1] if self.host.metrics else None
            kv_now = f" ({point.kv_usage * 100:.1f}% now)" if point and point.kv_usage is not None else ""
            texts = notices(source, kv_now, prefix_cache_line(source, self.host.prefix_cache))
        for key, cover in self.covers.items():
            cover.cover(texts.get(key))

    @Slot(object)
    def _on_model_loaded(self, event) -> None:
        if not self.host.attached:
            return
        # A sweep would load and measure the model on this machine, not on the server's. (The
        # roofline places a kvscope server's steps by the costs its events carry.)
        self.sweep.set_model(None)

    @Slot(str)
    def _on_load_failed(self, _message: str) -> None:
        self.detach_action.setEnabled(self.host.attached)


def _is_connection_loss(message: str) -> bool:
    """RemoteEngine's words for a server that went away (engine.remote: a failed connection, a
    broken events stream), as against a request the server refused."""
    return "connection to" in message or "events stream" in message
