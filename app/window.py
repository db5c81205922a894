"""The main window: the chat in the middle, the inspection panels and controls in docks.

Docks can be moved, tabbed, floated and closed; their arrangement and the window geometry are
saved on close and restored on the next launch (View > Reset layout brings the default back).
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QEvent, QObject, QSize, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFrame,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QTabBar,
    QToolBar,
    QToolButton,
    QWidget,
)

from app.batching.load_tool import LoadToolPanel
from app.chat.controller import ChatController
from app.chat.conversation_list import ConversationList
from app.chat.conversations import ConversationStore
from app.chat.tabs import ChatTabs
from app.chat.view import ChatPane
from app.chat.window_actions import ChatWindowActions, mark_interrupted
from app.controls_dock import ControlsPanel
from app.engine_host import EngineHost
from app.gui_gc import GuiThreadCollector
from app.inside.docks import InsideViews
from app.panels import Panels, PlotPass, build_panels
from app.physics.views import PhysicsViews
from app.quality.controller import QualityController
from app.remote.host import AttachableHost
from app.remote.views import RemoteViews
from app.sampling_presets import PresetStore
from app.settings import AppSettings, ModelChoice
from app.speculation.view import SpeculationController
from app.status_bar import StatusBar
from app.tools.registry import ToolRegistry
from app.what_if import WhatIfController
from app.wheel_guard import install_wheel_guard
from engine.config import DEFAULT_KV_BUDGET_BYTES, ConfigError, EngineConfig

# ~3 Hz: status text is read, not watched; formatting it every frame would only cost time.
SLOW_INTERVAL_MS = 333
# How long the status bar shows a load's estimate beside its measurement (then the model's name).
MEASURED_VISIBLE_MS = 20_000
DEFAULT_SIZE = (1560, 960)
# Of the window, the first-run layout gives the left column (conversations over controls) and the
# probability bars on the right this much width, and the row of live graphs this much height;
# the chat keeps the rest. Fractions, so that 1366x768 and 2560x1440 get the same arrangement.
LEFT_SHARE, RIGHT_SHARE, BOTTOM_SHARE = 0.2, 0.25, 0.27
# Narrower than this, the first-run layout tabs memory with latency instead of a third column.
COMPACT_WIDTH = 1700
# The least left column on a screen with room for it (a narrower window wraps the Controls' rows).
MIN_LEFT_WIDTH = 270


# Of a screen larger than DEFAULT_SIZE, the first window takes this share (a 1920x1080 screen
# gets 1766x994 minus its panels' frame): the panels are worth the room.
SCREEN_SHARE = 0.92


def first_run_size(available: tuple[int, int]) -> tuple[int, int]:
    """The first window's size on a screen whose free area is `available`: all of it when that
    is smaller than DEFAULT_SIZE (a 1366x768 laptop), else SCREEN_SHARE of it, at least
    DEFAULT_SIZE."""
    return tuple(  # type: ignore[return-value]
        min(have, max(default, round(SCREEN_SHARE * have))) for default, have in zip(DEFAULT_SIZE, available)
    )


WELCOME = (
    "Chat with the model here, and watch it think in the panels around:\n"
    "the probability of every candidate token, the KV-cache pages filling up, memory and latency."
)


class _NoHeightForWidth(QWidget):
    """Holds a panel at its own size with no height for width. A panel whose layout has one (a
    word-wrapped legend over a plot) asks, as a tab hidden behind another at some narrow width,
    for the height its legend would wrap to there, and holds its whole row of docks that tall."""

    def __init__(self, panel: QWidget):
        super().__init__()
        self.panel = panel
        panel.setParent(self)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.panel.setGeometry(self.rect())  # before Qt sizes a first-shown child to its hint
        super().showEvent(event)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return self.panel.minimumSizeHint()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return self.panel.sizeHint()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.panel.setGeometry(self.rect())
        super().resizeEvent(event)


class MainWindow(QMainWindow):
    def __init__(
        self,
        settings: AppSettings,
        conversations: ConversationStore,
        host: EngineHost | None = None,
        interactive: bool = True,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        install_wheel_guard()  # once per application: every dock's and dialog's fields
        self._collector = GuiThreadCollector(self)  # Python's collector runs on this thread only
        self.installEventFilter(self)  # its layout requests (eventFilter)
        self.setWindowTitle("kvscope")
        self.setObjectName("mainWindow")
        self.settings = settings
        self.conversations = conversations
        # Local by default; Remote > Attach puts a remote server where the engine was.
        self.host = host or AttachableHost(parent=self)
        # Scripted runs must never block on a dialog; they report errors on stderr instead.
        self.interactive = interactive
        self.load_failures: list[str] = []
        self._measuring = None  # the ModelLoaded whose estimate waits for a memory sample

        self.chat = ChatPane()
        self.chat.transcript.set_placeholder(WELCOME)
        self.sidebar = ConversationList()
        self.controls = ControlsPanel(
            settings.sampling(),
            settings.model_choice(),
            DEFAULT_KV_BUDGET_BYTES,
            presets=PresetStore(settings),
            token_texts=settings.token_texts(),
        )
        # A due plot redraws a few ms after the frame's other panels, in a paint pass of its own.
        self.plot_pass = PlotPass(self)
        self.panels: Panels = build_panels(self.host.live, defer=self.plot_pass.defer)
        self.status = StatusBar()
        self.setStatusBar(self.status)
        # Replies a crash or a kill cut off mid-stream: marked before anything shows them as finished.
        self.interrupted_replies = mark_interrupted(conversations)
        # MCP servers and their tools, shared by every chat tab (each chooses whether to use them).
        self.tools = ToolRegistry(settings, parent=self)
        self.tools.load()
        if conversations.read_only:
            self.chat.banner.show_message(conversations.read_only_banner)
        self.controller = ChatController(
            self.chat,
            self.sidebar,
            conversations,
            self.host,
            self.controls.sampling.params,
            parent=self,
            context_policy=settings.context_policy,
            tools=self.tools,
        )
        # The chat is the first of the chat tabs; more tabs generate at the same time.
        self.chat_tabs = ChatTabs(
            self.chat,
            self.controller,
            conversations,
            self.host,
            self.controls.sampling.params,
            tools=self.tools,
        )
        self.controller.servers_wanted.connect(self.show_mcp_servers)
        self.chat_tabs.servers_wanted.connect(self.show_mcp_servers)
        self.setCentralWidget(self.chat_tabs)
        self.quality = QualityController(
            self.host, self.controller, self.panels, self.controls.model, parent=self
        )
        self.physics = PhysicsViews(self.host, self.panels.roofline, parent=self)
        self.what_if = WhatIfController(self.host, self.panels.probabilities, parent=self)
        self.load_tool = LoadToolPanel(self.host)
        self.speculation = SpeculationController(
            self.host,
            self.controller,
            self.chat_tabs,
            self.controls.sampling,
            self.controls.speculation,
            self.panels.speculation,
            self.start_engine,
            parent=self,
        )
        token_view, colour = settings.get("chat/view", [False, False])
        self.chat.token_view.setChecked(bool(token_view))
        self.chat.colour_tokens.setChecked(bool(colour))

        # export, import, rename, delete, branch, limit: the window only as the dialogs' parent
        self.chat_actions = ChatWindowActions(
            self,
            self.host,
            self.sidebar,
            self.panels.probabilities,
            settings,
            self.chat_tabs,
            self.controller,
            conversations,
            self.status,
        )
        self.controls.sampling.set_token_resolver(self.chat_actions.resolve_tokens)
        self.docks: dict[str, QDockWidget] = {}
        # Sized first: resizeDocks() below shares out this width and height among the docks.
        screen = self.screen().availableGeometry()
        self.resize(*first_run_size((screen.width(), screen.height())))
        self._placed = self.size()  # the size it was given: _fit_screen never shrinks below it
        self._build_docks()
        # the model's inside for the pinned token: the logit lens under the probabilities, the
        # attention, experts, scoring and steering tabbed beside them
        self.inside = InsideViews(
            self,
            self.host,
            lambda: [c.pinning.pinned for c in self.chat_tabs.controllers],
            self.panels.page_map,
            self._dock,
            self.docks["probabilities"],
        )
        self._build_toolbar()
        self._build_menus()
        self.remote_views = RemoteViews(
            self,
            self.host,
            self.docks,
            self._beside_latency,
            self.menuBar(),
            settings,
            self.controller,
            self.status,
            self.physics.sweep,
            refresh_status=self.refresh_status,
            detach=lambda: self.load_model(self.controls.model.choice()),
        )
        self._connect()
        self._default_state = self.saveState()
        self._restore_layout()
        self._keep_tab_titles_whole()

        self._slow = QTimer(self)
        self._slow.setInterval(SLOW_INTERVAL_MS)
        self._slow.timeout.connect(self.refresh_status)
        self._slow.start()
        self._closed = False
        self.controller.open_latest()
        if self.interrupted_replies:
            n = self.interrupted_replies
            self.status.showMessage(
                f"{n} repl{'ies were' if n > 1 else 'y was'} cut off when kvscope last stopped: marked "
                "interrupted, with Continue on the reply",
                15000,
            )
        self.controls.model.add_cached_models()
        self.controls.model.refresh_estimate()
        self.refresh_status()

    # ---- construction ----------------------------------------------------------------------
    def _dock(
        self,
        key: str,
        title: str,
        widget: QWidget,
        area: Qt.DockWidgetArea,
        scrolls: bool = False,
        graph: bool = False,
    ) -> QDockWidget:
        """A dock for `widget`; `scrolls` puts it in a scroll area, for a panel whose own minimum
        size would otherwise hold every dock tabbed with it (and the window) at that size. A
        `graph` (a wrapped legend over a plot) scrolls too, inside a _NoHeightForWidth: its height
        for width is the legend's plus the plot's preferred 480 px, which a scroll area would
        honour with a scroll bar at any size."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{key}")  # saveState/restoreState match docks by object name
        if scrolls or graph:
            area_widget = QScrollArea()
            area_widget.setObjectName(f"scroll_{key}")
            area_widget.setWidgetResizable(True)
            area_widget.setFrameShape(QFrame.Shape.NoFrame)
            area_widget.setWidget(_NoHeightForWidth(widget) if graph else widget)
            dock.setWidget(area_widget)
        else:
            dock.setWidget(widget)
        dock.setFeatures(
            QDockWidget.DockWidgetFeature.DockWidgetMovable
            | QDockWidget.DockWidgetFeature.DockWidgetFloatable
            | QDockWidget.DockWidgetFeature.DockWidgetClosable
        )
        self.addDockWidget(area, dock)
        dock.dockLocationChanged.connect(self._keep_tab_titles_whole)  # a new tab group, a new bar
        self.docks[key] = dock
        return dock

    @Slot()
    def _keep_tab_titles_whole(self) -> None:
        """Tabbed docks show their whole titles ("Latency", not "L…"): where a group's tabs do
        not fit its width, the bar scrolls (Qt's arrows) instead of eliding every title."""
        for bar in self.findChildren(QTabBar):
            if bar.parent() is self:  # the main window's dock tab bars, not a panel's own tabs
                bar.setElideMode(Qt.TextElideMode.ElideNone)
                bar.setUsesScrollButtons(True)

    def _beside_latency(self, key: str, title: str, widget: QWidget) -> QDockWidget:
        """A dock along the bottom, tabbed behind the latency graph (which stays in front)."""
        dock = self._dock(key, title, widget, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.tabifyDockWidget(self.docks["latency"], dock)
        self.docks["latency"].raise_()
        return dock

    def _build_docks(self) -> None:
        left, right, bottom = (
            Qt.DockWidgetArea.LeftDockWidgetArea,
            Qt.DockWidgetArea.RightDockWidgetArea,
            Qt.DockWidgetArea.BottomDockWidgetArea,
        )
        # The graphs run along the bottom under the chat and the left column; the probability
        # bars keep the full height on the right (a long candidate list reads top to bottom).
        self.setCorner(Qt.Corner.BottomLeftCorner, bottom)
        self.setCorner(Qt.Corner.BottomRightCorner, right)
        conversations = self._dock("conversations", "Conversations", self.sidebar, left)
        controls = self._dock("controls", "Controls", self.controls, left)
        self.splitDockWidget(conversations, controls, Qt.Orientation.Vertical)
        probabilities = self._dock("probabilities", "Token probabilities", self.panels.probabilities, right)
        # scrolls: its wrapped notes would otherwise hold the row of graphs (and the window)
        # taller than a 540 px screen
        page_map = self._dock("page_map", "KV-cache pages", self.panels.page_map, bottom, scrolls=True)
        # Below COMPACT_WIDTH (a 1366 px laptop, a 2560 px screen at 200%) three graphs side by
        # side would each be too narrow to read: memory becomes a tab of the latency group.
        compact = self.width() < COMPACT_WIDTH
        # the row's graphs scroll too: the tallest least height of a tab group holds the whole
        # row (and the window) that tall, which on a 960x540 screen it could not be
        memory = self._dock("memory", "Memory", self.panels.memory, bottom, graph=True)
        latency = self._dock("latency", "Latency", self.panels.latency, bottom, graph=True)
        self.splitDockWidget(page_map, latency if compact else memory, Qt.Orientation.Horizontal)
        if compact:
            self.tabifyDockWidget(latency, memory)
        else:
            self.splitDockWidget(memory, latency, Qt.Orientation.Horizontal)
        quality = self._dock("quality", "Quantization quality", self.panels.quality, bottom, scrolls=True)
        self.tabifyDockWidget(latency, quality)
        roofline = self._dock("roofline", "Roofline", self.panels.roofline, bottom, scrolls=True)
        self.tabifyDockWidget(latency, roofline)
        steps = self._dock("step_timeline", "Engine steps", self.panels.step_timeline, bottom, graph=True)
        self.tabifyDockWidget(latency, steps)
        speculation = self._dock("speculation", "Speculation", self.panels.speculation, bottom, scrolls=True)
        self.tabifyDockWidget(latency, speculation)
        # The load tool submits many requests at once; a tool to open (View menu), tabbed
        # beside the probabilities where it has the height for its table and plot.
        load_tool = self._dock("load_tool", "Load test", self.load_tool, right, scrolls=True)
        self.tabifyDockWidget(probabilities, load_tool)
        latency.raise_()
        # The calculator and the sweeps need height more than width: tabs beside the probabilities.
        kv_calculator = self._dock(
            "kv_calculator", "KV memory calculator", self.physics.kv_calculator, right, scrolls=True
        )
        sweep = self._dock("sweep", "Latency sweeps", self.physics.sweep, right, scrolls=True)
        self.tabifyDockWidget(probabilities, kv_calculator)
        self.tabifyDockWidget(probabilities, sweep)
        probabilities.raise_()
        # Each wants 470-740 px of width, which would take it from the chat and the live graphs
        # (a tab's width counts even behind another tab): tools to open when needed (View or
        # Physics menu), not live views.
        kv_calculator.hide()
        sweep.hide()
        load_tool.hide()
        width, height = self.width(), self.height()
        # wide enough that no Controls row wraps, where the chat keeps its least width beside it;
        # on a narrow window (960x540) what is left, its rows wrapped
        room = width - round(RIGHT_SHARE * width) - self.centralWidget().minimumSizeHint().width() - 24
        left = min(max(MIN_LEFT_WIDTH, round(LEFT_SHARE * width), self.controls.unwrapped_width()), room)
        bottom = round(BOTTOM_SHARE * height)
        self.resizeDocks([conversations, controls], [height // 6, height - bottom], Qt.Orientation.Vertical)
        self.resizeDocks(
            [conversations, probabilities], [left, round(RIGHT_SHARE * width)], Qt.Orientation.Horizontal
        )
        # the page map a little wider than memory and latency: its grid of blocks reads across
        share = (width - round(RIGHT_SHARE * width)) // (2 if compact else 3)
        row = [page_map, latency] if compact else [page_map, memory, latency]
        self.resizeDocks(
            row,
            [share * 9 // 10 if compact else share * 5 // 4, *[share] * (len(row) - 1)],
            Qt.Orientation.Horizontal,
        )
        self.resizeDocks([page_map], [bottom], Qt.Orientation.Vertical)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        models = self.controls.model.actions  # also in the toolbar and the picker's Open… menu
        file_menu.addActions([models.open_file, models.open_folder])
        file_menu.addSeparator()
        file_menu.addActions([models.hub, models.on_this_machine])
        file_menu.addSeparator()
        self._action(
            file_menu, "&New conversation", self.controller.new_conversation, QKeySequence.StandardKey.New
        )
        file_menu.addSeparator()
        self.chat_actions.fill_file_menu(file_menu)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat_menu = self.menuBar().addMenu("&Chat")
        self._action(chat_menu, "&Stop reply", self.controller.stop, "Ctrl+.")
        self._action(chat_menu, "&Regenerate reply", self.controller.regenerate, "Ctrl+R")
        self._action(chat_menu, "&Edit last message", self.controller.edit_last, "Ctrl+E")
        self.chat_actions.fill_chat_menu(chat_menu)
        chat_menu.addSeparator()
        self._action(chat_menu, "Structured &output…", self.controller.edit_structured_output)
        self._action(chat_menu, "&MCP servers…", self.show_mcp_servers)
        view_menu = self.menuBar().addMenu("&View")
        view_menu.addAction(self.toolbar.toggleViewAction())
        for dock in self.docks.values():
            view_menu.addAction(dock.toggleViewAction())
        view_menu.addSeparator()
        self._action(view_menu, "&Reset layout", self.reset_layout)
        self.physics.fill_menu(self.menuBar().addMenu("&Physics"), self.docks)
        help_menu = self.menuBar().addMenu("&Help")
        self._action(help_menu, "&About kvscope", self._about)

    def _build_toolbar(self) -> None:
        """The ways to a model, one click away: a file, the Hub, the models already here."""
        models = self.controls.model.actions
        self.toolbar = QToolBar("Model toolbar", self)
        self.toolbar.setObjectName("modelToolbar")  # saveState matches toolbars by name
        self.toolbar.setMovable(False)
        self.toolbar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        for action, label in (
            (models.open_file, "Open model…"),
            (models.hub, "Hugging Face Hub…"),
            (models.on_this_machine, "On this machine…"),
        ):
            button = QToolButton(self.toolbar)
            button.setDefaultAction(action)
            button.setText(label)  # shorter than the menu's wording; the action's tooltip stays
            self.toolbar.addWidget(button)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, self.toolbar)

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _connect(self) -> None:
        host = self.host
        host.frame.connect(self._on_frame)
        host.model_loaded.connect(self._on_model_loaded)
        host.model_load_failed.connect(self._on_model_load_failed)
        host.engine_error.connect(self._on_engine_error)
        host.model_loading.connect(self._on_model_loading)
        self.controller.token_inspected.connect(self._on_token_inspected)
        self.controller.status_message.connect(self._on_status_message)
        self.chat_tabs.token_inspected.connect(self._on_token_inspected)
        self.chat_tabs.status_message.connect(self._on_status_message)
        self.controls.sampling.changed.connect(self._on_sampling_changed)
        self.controls.sampling.what_if_changed.connect(self._on_what_if_changed)
        self.controls.model.load_requested.connect(self.load_model)
        self.chat.view_changed.connect(self._on_view_changed)

    # ---- layout ----------------------------------------------------------------------------
    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
        """The window's own layout requests: back within the screen once Qt has laid it out.
        A filter, not an `event` override: an override is Python around every event of the
        window, its paints among them, and Python's lock is held while Qt paints every widget
        under it (the engine's thread waits for it between its kernels); a filter returns before
        the event is delivered."""
        if watched is self and event.type() == QEvent.Type.LayoutRequest:
            QTimer.singleShot(0, self, self._fit_screen)
        return False

    def _fit_screen(self) -> None:
        """Back within the screen once the panels allow it. Qt grows a window whose minimum grows
        (a load's progress and stage under the Load button, while it loads) and never shrinks it
        again: on a 960x540 screen the window stayed 6 px taller than the screen after the load."""
        if self.isMaximized() or self.isFullScreen() or not self.isVisible():
            return
        screen = self.screen().availableGeometry()
        frame = self.frameGeometry().size() - self.size()  # the window manager's decoration
        # the screen's room, or the size it was placed at where that is larger (a test's screen)
        room = (screen.size() - frame).expandedTo(self._placed)
        if self.width() <= room.width() and self.height() <= room.height():
            return  # the common case: no layout asked of the docks
        least = self.minimumSizeHint().expandedTo(self.minimumSize())
        width = min(self.width(), max(least.width(), room.width()))
        height = min(self.height(), max(least.height(), room.height()))
        if (width, height) != (self.width(), self.height()):
            self.resize(width, height)

    def _restore_layout(self) -> None:
        geometry, state = self.settings.window_layout()
        if geometry is not None:
            self.restoreGeometry(geometry)
            self._placed = self.size()
        if state is not None:
            self.restoreState(state)

    @Slot()
    def reset_layout(self) -> None:
        self.restoreState(self._default_state)
        for dock in self.docks.values():
            dock.show()

    def save_layout(self) -> None:
        self.settings.set_window_layout(self.saveGeometry(), self.saveState())
        self.settings.sync()

    # ---- engine ----------------------------------------------------------------------------
    def start_engine(self, config: EngineConfig, loaded=None) -> None:
        """Start (or restart) the engine; `loaded` skips loading (tests, the measure command)."""
        self.host.start(config, loaded=loaded)
        self.controller.sync_state()
        self.refresh_status()

    @Slot(object)
    def load_model(self, choice: ModelChoice) -> None:
        try:
            config = self.speculation.with_speculation(choice.engine_config())
        except ConfigError as exc:
            self._on_status_message(str(exc), "error")
            return
        if self.controller.active is not None:
            self.controller.stop()
        self.settings.set_model_choice(choice)
        self.release_engine()
        self.start_engine(config)

    def release_engine(self) -> None:
        """Stop the running engine and free its model before the next loads: the process holds
        one model at a time, not two (the old engine's objects refer to each other, so without a
        collection here they would wait for Python's garbage collector)."""
        from engine.api import give_back_freed_memory

        self.host.stop()
        gc.collect()  # on the GUI thread, the one place collecting Qt objects is safe
        give_back_freed_memory()

    @Slot(object)
    def _on_frame(self, dirty: set[str]) -> None:
        self.panels.refresh(dirty)
        if self._measuring is not None and "memory" in dirty:
            self._show_measured()

    def _show_measured(self) -> None:
        """The load's estimate beside its measurement, once a memory sample taken after the load
        has arrived."""
        loaded = self._measuring
        memory = self.host.live.memory
        if loaded is None or not len(memory) or memory.column("t")[-1] < loaded.t:
            return
        self._measuring = None
        picker = self.controls.model
        picker.show_measured(loaded.info.weight_bytes, int(memory.column("process")[-1]))
        # also where the eye is after a load, for a while: the picker's note may be scrolled away
        # the figures without their "(estimate +4%)": the status bar is one short line
        figures = [line.split(" (estimate ")[0] for line in picker.measured.text().split("\n")[1:]]
        self.status.showMessage(
            f"Loaded {loaded.info.name}. Estimated → measured: {'; '.join(figures)}", MEASURED_VISIBLE_MS
        )

    def _on_model_loading(self, event) -> None:
        self.controls.model.show_loading(event.stage, event.fraction)
        self.refresh_status()

    @Slot(object)
    def _on_model_loaded(self, event) -> None:
        self.controls.model.show_loading(None)
        if self.host.config is not None:  # a local engine: its estimate meets its measurement
            self._measuring = event
            self._show_measured()
        self.controller.forget_token_data()
        self.controls.sampling.tokens.resolve_now()  # the bias and bans as this model's tokens
        self.chat.input.setPlaceholderText(
            f"Message {event.info.name}…  (Enter sends, Shift+Enter for a new line)"
        )
        if event.info.chat_note:  # a system prompt merged, or plain text for a template-less model
            self.status.showMessage(event.info.chat_note, 30_000)
        self.refresh_status()

    @Slot(str)
    def _on_model_load_failed(self, message: str) -> None:
        self.controls.model.show_loading(None)
        self.load_failures.append(message)
        self.status.show_error(f"Model failed to load: {message}")
        self.refresh_status()
        if self.interactive:
            box = QMessageBox(QMessageBox.Icon.Warning, "The model could not be loaded", message, parent=self)
            box.setInformativeText("Choose another model (File > Open model file…, or the Hub) and load it.")
            box.open()  # window-modal, not blocking: the app keeps running behind it

    @Slot(str)
    def _on_engine_error(self, message: str) -> None:
        self.status.show_error(f"Engine error: {message}")

    @Slot(str, str)
    def _on_status_message(self, text: str, kind: str) -> None:
        if kind == "error":
            self.status.show_error(text)
        else:
            self.status.showMessage(text, 5000)

    @Slot()
    def refresh_status(self) -> None:
        self.status.refresh(self.host.live, self.host.model_name)

    # ---- panels and controls ---------------------------------------------------------------
    @Slot(object, object)
    def _on_token_inspected(self, request_id, index) -> None:
        self.panels.probabilities.show_token(request_id, index)
        self.inside.on_token_inspected(request_id, index)

    @Slot(object)
    def _on_what_if_changed(self, params) -> None:
        self.panels.probabilities.set_what_if(params)

    @Slot(object)
    def _on_sampling_changed(self, params) -> None:
        self.settings.set_sampling(params, self.controls.sampling.token_texts())
        for controller in self.chat_tabs.controllers:
            controller.schedule_measure()  # the reply's room follows max_new_tokens

    @Slot(bool, bool)
    def _on_view_changed(self, token_view: bool, colour: bool) -> None:
        self.settings.set("chat/view", [token_view, colour])

    @Slot()
    def show_mcp_servers(self) -> None:
        from app.tools.servers_dialog import ServersDialog

        dialog = ServersDialog(self.tools, self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()

    @Slot()
    def _about(self) -> None:
        QMessageBox.about(
            self,
            "About kvscope",
            "kvscope: chat with a local language model while watching its inference live.\n\n"
            "Every number on screen comes from the running engine: token distributions, the paged "
            "KV cache, memory and latency.",
        )

    # ---- closing ---------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        if not self._closed:
            self._closed = True
            self.save_layout()
            self.settings.set_sampling(self.controls.sampling.params(), self.controls.sampling.token_texts())
            # cancel -> stop -> join; the cancelled reply's final text is folded and saved here.
            self.host.shutdown()
            self.quality.shutdown()  # a quality run finishes its current step, then stops
            self.physics.shutdown()  # a sweep stops at its next run; a limits measurement finishes
            self.speculation.shutdown()  # a speedup measurement stops at its next run
            self.controls.model.wait_for_estimate()
            self.tools.close()  # every MCP server's session left (stdio servers stop)
            for timer in self.findChildren(QTimer):  # nothing may tick into a closed window
                timer.stop()
            self._collector.release()  # the engine threads are gone: automatic collection may return
        super().closeEvent(event)
