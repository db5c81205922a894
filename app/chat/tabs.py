"""Several chats generating at once: one tab per conversation, all on the one engine.

The first tab is the window's own chat (its controller drives the sidebar, menus and exports).
Each further tab gets its own ChatPane and ChatController, so its conversation is stored like any
other and the engine batches its replies with the others'. A tab generating shows a swatch in
its sequence's page-map colour (the engine's request id is the pool's sequence id), so the blocks
of each tab can be found in the KV-cache pages panel.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Signal, Slot
from PySide6.QtGui import QColor, QIcon, QPixmap
from PySide6.QtWidgets import QTabWidget, QToolButton, QWidget

from app.chat.controller import ChatController
from app.chat.conversation_list import ConversationList
from app.chat.conversations import ConversationStore
from app.chat.view import ChatPane
from app.engine_host import EngineHost
from app.tools.registry import ToolRegistry
from engine.config import SamplingParams
from widgets import theme

SWATCH_PX = 12


def seq_swatch(request_id: int) -> QIcon:
    pixmap = QPixmap(SWATCH_PX, SWATCH_PX)
    pixmap.fill(QColor(*theme.seq_rgb(request_id)))
    return QIcon(pixmap)


class ChatTabs(QTabWidget):
    token_inspected = Signal(object, object)  # from the extra tabs' controllers
    status_message = Signal(str, str)
    servers_wanted = Signal()  # an extra tab asked to manage the MCP servers

    def __init__(
        self,
        main_pane: ChatPane,
        main_controller: ChatController,
        store: ConversationStore,
        host: EngineHost,
        sampling: Callable[[], SamplingParams],
        parent: QWidget | None = None,
        context_policy: Callable[[], str] | None = None,
        tools: ToolRegistry | None = None,
    ) -> None:
        super().__init__(parent)
        self.store, self.host, self.sampling = store, host, sampling
        self.tools = tools
        self.context_policy = context_policy or main_controller.context_policy
        self.controllers: list[ChatController] = [main_controller]
        self.addTab(main_pane, "Chat 1")
        self.setTabToolTip(0, "The chat the sidebar, menus and exports act on")
        self.setTabsClosable(True)
        self.tabBar().setTabButton(0, self.tabBar().ButtonPosition.RightSide, None)  # the main tab stays
        new_tab = QToolButton()
        new_tab.setText("+")
        new_tab.setToolTip("New chat tab: another conversation generating at the same time")
        new_tab.clicked.connect(self.add_tab)
        self.setCornerWidget(new_tab)
        self.new_tab_button = new_tab
        self.tabCloseRequested.connect(self.close_tab)
        # status_changed comes after a frame's events are dispatched, so every controller has
        # already taken up or ended its reply when the swatches are set.
        host.request_started.connect(self._sync_swatches)
        host.status_changed.connect(self._sync_swatches)
        host.request_finished.connect(self._refresh_main_sidebar)

    @Slot()
    def add_tab(self) -> ChatController:
        pane = ChatPane()
        # The sidebar belongs to the first tab; an extra tab starts a new conversation and keeps
        # its own (never shown) list, so a click in the window's sidebar moves only the first tab.
        sidebar = ConversationList()
        controller = ChatController(
            pane,
            sidebar,
            self.store,
            self.host,
            self.sampling,
            self,
            context_policy=self.context_policy,
            tools=self.tools,
        )
        controller.token_inspected.connect(self.token_inspected)
        controller.servers_wanted.connect(self.servers_wanted)
        controller.status_message.connect(self.status_message)
        main = self.controllers[0].pane
        pane.token_view.setChecked(main.token_view.isChecked())
        pane.colour_tokens.setChecked(main.colour_tokens.isChecked())
        self.controllers.append(controller)
        self.setCurrentIndex(self.addTab(pane, f"Chat {len(self.controllers)}"))
        return controller

    @Slot(int)
    def close_tab(self, index: int) -> None:
        if index == 0:
            return
        controller = self.controllers[index]
        if controller.active is not None:
            # Closing now would drop the reply before its end is stored: stop first.
            self.status_message.emit("Stop this tab's reply before closing the tab", "info")
            return
        pane = self.widget(index)
        assert pane is not None, "a tab holds its pane"
        self.removeTab(index)
        self.controllers.pop(index)
        controller.detach()
        controller.sidebar.deleteLater()
        controller.deleteLater()
        pane.deleteLater()

    def controller_for_request(self, request_id: int) -> ChatController | None:
        """The tab whose replies include the tokens of `request_id` (a branch point)."""
        return next((c for c in self.controllers if c.owns_request(request_id)), None)

    def active_request_ids(self) -> list[int | None]:
        """Each tab's generating request id (None when idle), in tab order."""
        return [c.active.record.request_id if c.active else None for c in self.controllers]

    @Slot()
    def _sync_swatches(self, _event: object = None) -> None:
        for i, request_id in enumerate(self.active_request_ids()):
            if request_id is None:
                self.setTabIcon(i, QIcon())
                self.setTabToolTip(i, "")
            else:
                self.setTabIcon(i, seq_swatch(request_id))
                self.setTabToolTip(
                    i, f"Generating: sequence #{request_id} (this colour in the KV-cache pages)"
                )

    @Slot()
    def _refresh_main_sidebar(self, _event: object = None) -> None:
        # Replies in other tabs add and retitle conversations the window's sidebar lists.
        if self.count() > 1 and self.controllers[0].active is None:
            self.controllers[0].refresh_sidebar()
