"""The pinned token's inside: when a token of a reply is pinned (clicked), the engine recomputes
its step (EngineClient.inspect_token: the logit lens and every head's attention, from one replay of
its context over the blocks it read) and, on a mixture of experts, the routes of its reply's
tokens (EngineClient.expert_routes); the panels draw the answers, the page map outlines the blocks
the chosen head's layer read. Nothing is asked while a token is merely hovered, nor for a panel
that is not on screen (it is asked when the panel is shown), so generation never pays for a view
nobody looks at.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Slot

from app.engine_host import EngineHost
from app.inside.latest import LatestCall
from engine.inside import ExpertRoutes, TokenInside
from engine.request import Request
from widgets.attention_view import AttentionPanel
from widgets.expert_view import ExpertPanel
from widgets.kv_page_map import KVPageMapPanel
from widgets.lens_strip import LensStrip

NOT_KNOWN = "this token's request is no longer known to the engine (a reply of an earlier engine)"


@dataclass(frozen=True, slots=True)
class PinnedToken:
    """A reply's token as the engine is asked about it."""

    request_id: int
    index: int
    request: Request
    output_ids: tuple[int, ...]  # the reply before the token
    reply_ids: tuple[int, ...]  # the whole reply
    token_id: int
    text: str


def cost_text(engine_s: float, draw_s: float) -> str:
    return f" · {engine_s * 1000:.0f} ms on the engine, {draw_s * 1000:.0f} ms to draw"


class TokenViews(QObject):
    def __init__(
        self,
        host: EngineHost,
        pinned: Callable[[], list[tuple[int | None, int] | None]],
        lens: LensStrip,
        attention: AttentionPanel,
        experts: ExpertPanel,
        page_map: KVPageMapPanel,
        shown: Callable[[str], bool],
        parent: QObject | None = None,
    ) -> None:
        """`pinned()`: the tokens pinned in the chats (request id, index); `shown(name)`: whether a
        panel ("lens", "attention", "experts") is on screen."""
        super().__init__(parent)
        self.host, self.pinned, self.shown = host, pinned, shown
        self.lens, self.attention, self.experts, self.page_map = lens, attention, experts, page_map
        self.token: PinnedToken | None = None
        self._inside = LatestCall(host, "the inside of a token", self)
        self._routes = LatestCall(host, "expert routes", self)
        self._asked_inside: tuple[int, int, int] | None = None  # (engine generation, request, index)
        self._asked_routes: tuple[int, int, int] | None = None  # (engine generation, request, reply length)
        self.last_inside: TokenInside | None = None
        self.last_routes: ExpertRoutes | None = None
        attention.blocks_read.connect(self._outline)

    # ---- selection -------------------------------------------------------------------------
    @Slot(object, object)
    def on_token_inspected(self, request_id: int | None, index: int | None) -> None:
        """A token hovered or pinned: only a pinned one is inspected."""
        if request_id is None or index is None or (request_id, index) not in self.pinned():
            return
        self.inspect(request_id, index)

    def inspect(self, request_id: int, index: int) -> None:
        token = self._resolve(request_id, index)
        if token is None:
            for panel in (self.lens, self.attention, self.experts):
                panel.show_message(NOT_KNOWN)
            return
        self.token = token
        self.refresh()

    def _resolve(self, request_id: int, index: int) -> PinnedToken | None:
        request = self.host.request(request_id)
        view = self.host.live.requests.get(request_id)
        token = self.host.live.token(request_id, index)
        if request is None or view is None or token is None:
            return None
        reply = tuple(t.token_id for t in view.tokens)
        return PinnedToken(request_id, index, request, reply[:index], reply, token.token_id, token.text)

    @Slot()
    def refresh(self) -> None:
        """Ask what the panels on screen need for the pinned token (each once per token)."""
        token = self.token
        if token is None:
            return
        generation = self.host.generation
        if self.shown("lens") or self.shown("attention"):
            key = (generation, token.request_id, token.index)
            if key != self._asked_inside:
                self._asked_inside = key
                self._ask_inside(token)
        if self.shown("experts"):
            # the routes of the whole reply: asked again only when the reply grew or changed
            key = (generation, token.request_id, len(token.reply_ids))
            if key != self._asked_routes:
                self._asked_routes = key
                self._ask_routes(token)
            elif self.last_routes is not None:
                self._draw_routes(self.last_routes, token, 0.0)

    # ---- the lens and the attention ----------------------------------------------------------
    def _ask_inside(self, token: PinnedToken) -> None:
        waiting = "recomputing this token's step on the engine…"
        self.lens.show_message(waiting)
        self.attention.show_message(waiting)
        self._inside.ask(
            lambda engine: engine.inspect_token(token.request, token.output_ids, token.token_id),
            lambda inside: self._draw_inside(inside, token),
            self._inside_failed,
        )

    def _draw_inside(self, inside: TokenInside, token: PinnedToken) -> None:
        started = time.perf_counter()
        self.last_inside = inside
        if inside.lens is not None:
            self.lens.set_lens(inside.lens)
        else:
            self.lens.show_message(inside.lens_unavailable)
        self.attention.set_attention(inside.attention, token.text)
        self.lens.repaint()  # the drawing's own cost, measured: paint now rather than on the next pass
        self.attention.grid.repaint()
        cost = cost_text(inside.seconds, time.perf_counter() - started)
        self.lens.set_cost(f"replayed through {inside.executor}{cost}")
        self.attention.set_cost(
            f"{inside.reused_tokens} positions' K/V from the prefix cache as the reply's steps wrote them, "
            f"{inside.recomputed_tokens} recomputed{cost}"
        )

    def _inside_failed(self, message: str) -> None:
        self._asked_inside = None  # asked again on the next pin or refresh
        self.lens.show_message(message)
        self.attention.show_message(message)
        self.page_map.set_highlight(())

    def _outline(self, blocks: tuple[int, ...], note: str) -> None:
        inside = self.last_inside
        if inside is not None and blocks:
            # the replay reused the reply's full cached blocks and wrote the rest afresh (freed
            # after it): say which the outline is, so no one takes a fresh block for the reply's
            att = inside.attention
            own = set(att.block_ids[: inside.reused_tokens // att.block_size])
            reused = sum(1 for b in blocks if b in own)
            note += (
                f": {reused} the reply's own cached blocks, {len(blocks) - reused} written afresh "
                "by the replay (free again after it)"
            )
        self.page_map.set_highlight(blocks, note)

    # ---- experts ------------------------------------------------------------------------------
    def _ask_routes(self, token: PinnedToken) -> None:
        self.experts.show_message("routing the reply's tokens again on the engine…")
        self._routes.ask(
            lambda engine: engine.expert_routes(token.request, token.reply_ids),
            lambda routes: self._routes_answered(routes, token),
            self._routes_failed,
        )

    def _routes_answered(self, routes: ExpertRoutes, token: PinnedToken) -> None:
        self.last_routes = routes
        self._draw_routes(routes, token, routes.seconds)

    def _draw_routes(self, routes: ExpertRoutes, token: PinnedToken, engine_s: float) -> None:
        started = time.perf_counter()
        selected = routes.reply_start + token.index
        self.experts.set_routes(routes, selected if selected < len(routes.token_ids) else None)
        self.experts.maps.repaint()
        self.experts.set_cost(cost_text(engine_s, time.perf_counter() - started).removeprefix(" · "))

    def _routes_failed(self, message: str) -> None:
        # kept as asked: a dense model's answer does not change until another token is pinned
        self.last_routes = None
        self.experts.show_message(message)
