"""KV-cache page map: the whole block pool as a grid, with counters and a legend.

The grid is `KVPageCanvas`; this panel adds the counters (used / free / cached blocks, slot
utilisation, bytes), a legend naming the sequences currently holding blocks (a group's samples
or beams each by name and colour), and for n-sample and beam-search requests the memory that
sharing saves. Everything comes from the store's page map, which is folded exactly from the
engine's block events.
"""

from __future__ import annotations

import time

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.units import format_bytes
from live.groups import saving_line
from live.page_map import PageMap
from live.state import LiveState
from widgets import theme
from widgets.kv_page_canvas import COW_MARK, KVPageCanvas
from widgets.live_label import LiveLabel

LEGEND_MAX_SEQS = 6  # more requests than this are summarised as "+n more"
GROUP_LINES_MAX = 3  # saving lines for at most this many groups (running first, then the latest)


def _swatch(rgb: tuple[int, int, int], label: str, glyph: str = "■") -> str:
    # Qt rich text has no inline boxes; a coloured square glyph is the swatch.
    label = label.replace(" ", "&nbsp;")  # keep each entry on one line when the legend wraps
    return f"<span style='color:#{rgb[0]:02x}{rgb[1]:02x}{rgb[2]:02x}'>{glyph}</span>&nbsp;{label}"


def counters_text(pm: PageMap) -> str:
    used, free, cached = pm.used_blocks, pm.free_blocks, pm.cached_free_blocks
    slots_alloc = used * pm.block_size
    parts = [
        f"<b>{used}</b> used · {free - cached} free · {cached} cached"
        f" <span style='color:{theme.MUTED}'>of {pm.num_blocks} blocks × {pm.block_size} tokens</span>"
    ]
    if pm.shared_blocks:
        parts[0] += f" · {pm.shared_blocks} shared"
    if used:
        second = f"slots {pm.used_slots}/{slots_alloc} written (<b>{pm.utilisation * 100:.1f}%</b>)"
    else:
        second = "no slots in use"
    if pm.bytes_per_block:
        second += f" · KV {format_bytes(pm.used_bytes)} of {format_bytes(pm.pool_bytes)}"
    return parts[0] + "<br>" + second


def legend_text(pm: PageMap, state: LiveState | None = None) -> str:
    items = [
        _swatch(theme.BLOCK_FREE, "free"),
        _swatch(theme.BLOCK_CACHED_FREE, "cached prefix"),
        _swatch(theme.BLOCK_OUTLINE_SHARED, "shared (ref count)", "□"),
        "dim&nbsp;=&nbsp;unwritten",
    ]
    in_use = pm.ref_count > 0
    if (in_use & (pm.copied_from >= 0)).any():
        items.append(_swatch(COW_MARK, "copy-on-write copy", "◤"))
    # One entry per request: a group's samples or beams share it, a swatch each (the colour of
    # the blocks that sequence owns), so a few groups do not push the grid out of the panel.
    by_request: dict[int, list[int]] = {}
    for seq in (int(s) for s in np.unique(pm.first_owner[in_use])):
        by_request.setdefault(state.request_of_seq(seq) if state else seq, []).append(seq)
    for request_id, seqs in list(by_request.items())[:LEGEND_MAX_SEQS]:
        group = state.groups.get(request_id) if state else None
        label = f"request #{request_id}"
        if group is not None and group.is_group:
            noun = "beams" if group.kind == "beams" else "samples"
            label += f" · {max(len(group.live_seqs), len(seqs))} {noun}"
        swatches = "".join(_swatch(theme.seq_rgb(seq), "").removesuffix("&nbsp;") for seq in seqs)
        items.append(f"{swatches}&nbsp;{label.replace(' ', '&nbsp;')}")
    if len(by_request) > LEGEND_MAX_SEQS:
        items.append(f"+{len(by_request) - LEGEND_MAX_SEQS} more requests")
    return " &nbsp; ".join(items)


class KVPageMapPanel(QWidget):
    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.setObjectName("kvPageMapPanel")
        self.setStyleSheet(
            f"#kvPageMapPanel, #kvPageMapPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.counters = LiveLabel()
        self.counters.setTextFormat(Qt.TextFormat.RichText)
        self.counters.setWordWrap(True)
        self.canvas = KVPageCanvas()
        self.canvas.seq_label = state.seq_label
        # n samples / beams: "group: N blocks shared vs M unshared (saving P%), C copy-on-write".
        self.group_line = LiveLabel()
        self.group_line.setWordWrap(True)
        self.group_line.hide()
        # What the outlined blocks are (the blocks an inspected token's step read), when any are.
        self.highlight_note = QLabel()
        self.highlight_note.setWordWrap(True)
        self.highlight_note.setStyleSheet(f"color: {theme.MARK};")
        self.highlight_note.hide()
        self.legend = LiveLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.legend.setStyleSheet(f"color: {theme.MUTED};")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.counters)
        layout.addWidget(self.group_line)
        layout.addWidget(self.canvas, 1)
        layout.addWidget(self.highlight_note)
        layout.addWidget(self.legend)
        self._redraw()

    def set_highlight(self, blocks: tuple[int, ...], note: str = "") -> None:
        """Outline `blocks` on the map, saying what they are (empty: no outline)."""
        self.canvas.set_highlight(blocks)
        self.highlight_note.setText(note)
        self.highlight_note.setVisible(bool(blocks and note))

    def refresh(self, dirty: set[str]) -> None:
        # Also redraw while a just-written block is still fading back to its plain colour.
        if dirty & {"kv", "model", "groups"} or time.perf_counter() < self.canvas.glow_until:
            self._redraw()

    def _redraw(self) -> None:
        pm = self.state.page_map
        if pm.num_blocks == 0:
            self.counters.setText(f"<span style='color:{theme.MUTED}'>KV cache: no model loaded</span>")
            self.legend.setText("")
        else:
            self.legend.setText(legend_text(pm, self.state))
        self._redraw_group_line(pm)
        self.canvas.set_page_map(pm)
        if pm.num_blocks:
            text = counters_text(pm)
            if self.canvas.blocks_shown < pm.num_blocks:
                text += f" · grid shows blocks 0–{self.canvas.blocks_shown - 1} (enlarge the panel)"
            self.counters.setText(text)

    def _redraw_group_line(self, pm: PageMap) -> None:
        lines = group_lines(self.state, pm)
        self.group_line.setVisible(bool(lines))
        if lines:
            self.group_line.setText("\n".join(lines))


def group_lines(state: LiveState, pm: PageMap) -> list[str]:
    """A saving line per group request: those running, else the latest that ended."""
    groups = [g for g in state.groups.values() if g.is_group]
    running = [g for g in groups if not g.done]
    shown = running[-GROUP_LINES_MAX:] if running else groups[-1:]
    return [saving_line(g, pm) for g in shown]
