"""Chat text to the HTML subset Qt's rich-text engine draws: Markdown for reading, or one link
per generated token for inspecting.

Qt's HTML is HTML 4 with a little CSS, so code blocks become a one-cell table (the only block
that reliably takes a background colour and padding) and colours come from widgets.theme.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from markdown_it import MarkdownIt

from widgets import theme

TOKEN_LINK_PREFIX = "tok:"
# How a token whose text is only part of a multi-byte character (its delta is empty) appears in
# the token view, so it can still be hovered: a thin, muted dot.
PARTIAL_CHARACTER_MARK = "·"

_CODE_BLOCK = (
    '<table width="100%" cellspacing="0" cellpadding="8" style="margin: 4px 0px;" bgcolor="{bg}">'
    '<tr><td><pre style="white-space: pre-wrap; color: {fg}; font-family: monospace;">{code}</pre>'
    "{lang}</td></tr></table>"
)


def _render_code(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    code = html.escape(token.content.rstrip("\n"))
    lang = token.info.strip().split(" ")[0] if token.type == "fence" else ""
    label = (
        f'<p align="right" style="color: {theme.MUTED}; font-size: small;">{html.escape(lang)}</p>'
        if lang
        else ""
    )
    return _CODE_BLOCK.format(bg=theme.CODE_BG, fg=theme.CODE_TEXT, code=code, lang=label)


def _render_inline_code(self, tokens, idx, options, env) -> str:
    code = html.escape(tokens[idx].content)
    return (
        f'<code style="background-color: {theme.CODE_BG}; color: {theme.CODE_TEXT};'
        f' font-family: monospace;">&nbsp;{code}&nbsp;</code>'
    )


def _markdown() -> MarkdownIt:
    # Raw HTML off: a model's reply must never inject markup (or links) into the window.
    md = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable("table")
    md.add_render_rule("fence", _render_code)
    md.add_render_rule("code_block", _render_code)
    md.add_render_rule("code_inline", _render_inline_code)
    return md


_MD = _markdown()


def markdown_html(text: str) -> str:
    """A reply or message as Markdown. An unfinished code fence (mid-stream) renders as code."""
    return _MD.render(text)


def plain_html(text: str) -> str:
    """User text as typed: escaped, line breaks and spacing kept."""
    return f'<p style="white-space: pre-wrap;">{html.escape(text)}</p>'


@dataclass(frozen=True, slots=True)
class ReplyToken:
    """What the token view needs of one generated token."""

    index: int
    text_delta: str
    logprob: float

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


def token_html(
    tokens: Sequence[ReplyToken], selected: int | None = None, colour_by_probability: bool = False
) -> str:
    """The reply as one link per token (`tok:<index>`): hover or click one to inspect it."""
    parts = ['<p style="white-space: pre-wrap;">']
    for tok in tokens:
        text = tok.text_delta or PARTIAL_CHARACTER_MARK
        style = [f"color: {theme.TEXT if tok.text_delta else theme.MUTED}", "text-decoration: none"]
        background = theme.SELECTED_TOKEN_BG if tok.index == selected else None
        if background is None and colour_by_probability:
            background = theme.probability_background(tok.probability)
        if background:
            style.append(f"background-color: {background}")
        title = f"token {tok.index} · p = {tok.probability:.3f}"
        parts.append(
            f'<a href="{TOKEN_LINK_PREFIX}{tok.index}" title="{title}" style="{"; ".join(style)}">'
            f"{html.escape(text)}</a>"
        )
    parts.append("</p>")
    return "".join(parts)


def token_index_from_link(link: str) -> int | None:
    if not link.startswith(TOKEN_LINK_PREFIX):
        return None
    try:
        return int(link[len(TOKEN_LINK_PREFIX) :])
    except ValueError:
        return None


def probability_legend_html() -> str:
    """A one-line key for the token colouring, shown beside the toggle."""
    cells = []
    bounds = [b for b, _ in theme.PROBABILITY_SCALE]
    for i, (bound, colour) in enumerate(theme.PROBABILITY_SCALE):
        upper = 1.0 if i == 0 else bounds[i - 1]
        label = f"≥ {bound:g}" if i == 0 else f"{bound:g}–{upper:g}"
        bg = f' style="background-color: {colour};"' if colour else ""
        cells.append(f"<span{bg}>&nbsp;{label}&nbsp;</span>")
    return f'<span style="color: {theme.MUTED};">p: </span>' + " ".join(cells)
