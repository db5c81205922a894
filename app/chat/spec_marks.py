"""Speculative marks in the chat's token view: each token coloured by how its round produced it.

accepted   a draft token the target kept
resampled  drawn from the residual max(p - q, 0) after a draft was rejected
bonus      drawn from the target after every draft of the round was kept
(no mark)  a plain decode step

Text colour carries the mark, so the background stays free for the selection and the
colour-by-probability tint.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

from app.chat.rich_text import PARTIAL_CHARACTER_MARK, TOKEN_LINK_PREFIX, ReplyToken, lead_html
from widgets import theme

SPEC_MARK_COLOURS = {"accepted": theme.OK, "resampled": theme.ERROR, "bonus": theme.ACCENT}
SPEC_MARK_MEANINGS = {
    "accepted": "draft token the target kept",
    "resampled": "resampled after a rejected draft",
    "bonus": "bonus token after all drafts were kept",
}


def spec_token_html(
    tokens: Sequence[ReplyToken],
    mark_of: Callable[[int], str],
    selected: int | None = None,
    colour_by_probability: bool = False,
    lead: str = "",
) -> str:
    """The reply as one link per token (`tok:<position>`), each coloured by its speculative mark
    (`mark_of(position)`)."""
    parts = ['<p style="white-space: pre-wrap;">', lead_html(lead)]
    for position, tok in enumerate(tokens):
        mark = mark_of(position)
        text = tok.text_delta or PARTIAL_CHARACTER_MARK
        colour = SPEC_MARK_COLOURS.get(mark, theme.TEXT if tok.text_delta else theme.MUTED)
        style = [f"color: {colour}", "text-decoration: none"]
        if mark == "resampled":
            style.append("font-weight: bold")  # rejections are rarer and matter most: easy to find
        background = theme.SELECTED_TOKEN_BG if position == selected else None
        if background is None and colour_by_probability:
            background = theme.probability_background(tok.probability)
        if background:
            style.append(f"background-color: {background}")
        title = f"token {tok.index} · p = {tok.probability:.3f} · {mark or 'plain step'}"
        parts.append(
            f'<a href="{TOKEN_LINK_PREFIX}{position}" title="{title}" style="{"; ".join(style)}">'
            f"{html.escape(text)}</a>"
        )
    parts.append("</p>")
    return "".join(parts)


def spec_legend_html() -> str:
    """A one-line key for the marks, shown beside the toggle."""
    cells = [
        f'<span style="color: {SPEC_MARK_COLOURS[m]};" title="{SPEC_MARK_MEANINGS[m]}">{m}</span>'
        for m in SPEC_MARK_COLOURS
    ]
    return f'<span style="color: {theme.MUTED};">draft: </span>' + " · ".join(cells)
