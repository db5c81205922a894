"""Chat text to the HTML subset Qt's rich-text engine draws: Markdown for reading, or one link
per generated token for inspecting.

Qt's HTML is HTML 4 with a little CSS, so code blocks become a table (the only block that
reliably takes a background colour and padding) and colours come from widgets.theme. A fenced block
naming a language Pygments knows is highlighted with inline colours (Qt reads no style sheet
classes); every block has a "Copy" link (`copy:<n>`, n counting the reply's code blocks) whose
text `render_markdown` returns beside the HTML.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from widgets import theme

TOKEN_LINK_PREFIX = "tok:"
COPY_LINK_PREFIX = "copy:"
# How a token whose text is only part of a multi-byte character (its delta is empty) appears in
# the token view, so it can still be hovered: a thin, muted dot.
PARTIAL_CHARACTER_MARK = "·"
# A dark Pygments style whose colours read on theme.CODE_BG; only its token colours are used.
CODE_STYLE = "one-dark"
# Longer code is shown plain: highlighting is re-run on every render of a streaming reply.
MAX_HIGHLIGHT_CHARS = 20_000

_CODE_BLOCK = (
    '<table width="100%" cellspacing="0" cellpadding="6" style="margin: 4px 0px;" bgcolor="{bg}">'
    '<tr><td style="color: {muted}; font-size: small;">{lang}</td>'
    '<td align="right" style="font-size: small;"><a href="{link}" style="color: {accent};'
    ' text-decoration: none;">Copy</a></td></tr>'
    '<tr><td colspan="2"><pre style="white-space: pre-wrap; color: {fg}; font-family: monospace;">{code}</pre>'
    "</td></tr></table>"
)
_FORMATTER = HtmlFormatter(nowrap=True, noclasses=True, style=CODE_STYLE)


def highlighted(code: str, lang: str) -> str:
    """`code` as HTML: coloured spans when Pygments knows `lang`, else escaped text."""
    if lang and len(code) <= MAX_HIGHLIGHT_CHARS:
        try:
            lexer = get_lexer_by_name(lang, stripnl=False, ensurenl=False)
        except ClassNotFound:
            lexer = None
        if lexer is not None:
            return highlight(code, lexer, _FORMATTER).rstrip("\n")
    return html.escape(code)


def _render_code(
    self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    token = tokens[idx]
    code = token.content.rstrip("\n")
    lang = token.info.strip().split(" ")[0] if token.type == "fence" else ""
    blocks = env.setdefault("code_blocks", [])
    blocks.append(code)
    return _CODE_BLOCK.format(
        bg=theme.CODE_BG,
        fg=theme.CODE_TEXT,
        muted=theme.MUTED,
        accent=theme.ACCENT,
        lang=html.escape(lang),
        link=f"{COPY_LINK_PREFIX}{len(blocks) - 1}",
        code=highlighted(code, lang),
    )


def _render_inline_code(
    self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
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


def render_markdown(text: str) -> tuple[str, list[str]]:
    """A reply as Markdown, and the text of each of its code blocks (for their Copy links). An
    unfinished code fence (mid-stream) renders as code."""
    env: dict[str, Any] = {}
    rendered = _MD.render(text, env)
    return rendered, env.get("code_blocks", [])


def markdown_html(text: str) -> str:
    return render_markdown(text)[0]


def copy_index_from_link(link: str) -> int | None:
    if not link.startswith(COPY_LINK_PREFIX):
        return None
    try:
        return int(link[len(COPY_LINK_PREFIX) :])
    except ValueError:
        return None


def plain_html(text: str) -> str:
    """User text as typed: escaped, line breaks and spacing kept."""
    return f'<p style="white-space: pre-wrap;">{html.escape(text)}</p>'


@dataclass(frozen=True, slots=True)
class ReplyToken:
    """What the token view needs of one generated token. `request_id` and `index` name it in
    the engine's events; a branch shows its prefix's tokens from the reply they came from."""

    index: int
    text_delta: str
    logprob: float
    request_id: int | None = None

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


def token_html(
    tokens: Sequence[ReplyToken],
    selected: int | None = None,
    colour_by_probability: bool = False,
    lead: str = "",
) -> str:
    """The reply as one link per token (`tok:<position>`): hover or click one to inspect it.
    `selected` is a position in `tokens`; `lead` is text before them that has no tokens here
    (a reply continued after a restart)."""
    parts = ['<p style="white-space: pre-wrap;">', lead_html(lead)]
    for position, tok in enumerate(tokens):
        text = tok.text_delta or PARTIAL_CHARACTER_MARK
        style = [f"color: {theme.TEXT if tok.text_delta else theme.MUTED}", "text-decoration: none"]
        background = theme.SELECTED_TOKEN_BG if position == selected else None
        if background is None and colour_by_probability:
            background = theme.probability_background(tok.probability)
        if background:
            style.append(f"background-color: {background}")
        title = f"token {tok.index} · p = {tok.probability:.3f}"
        parts.append(
            f'<a href="{TOKEN_LINK_PREFIX}{position}" title="{title}" style="{"; ".join(style)}">'
            f"{html.escape(text)}</a>"
        )
    parts.append("</p>")
    return "".join(parts)


def lead_html(lead: str) -> str:
    return f'<span style="color: {theme.MUTED};">{html.escape(lead)}</span>' if lead else ""


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
