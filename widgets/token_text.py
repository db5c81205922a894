"""Token text made visible: whitespace and control characters shown as glyphs, not blanks."""

from __future__ import annotations

import html

# Glyphs for the characters a tokenizer produces most often where a plain label shows nothing.
_VISIBLE = {
    " ": "␣",
    "\n": "⏎",
    "\t": "⇥",
    "\r": "␍",
    "\u00a0": "⍽",  # no-break space
}


def visible(text: str, limit: int = 24) -> str:
    """`text` with whitespace as glyphs, other control characters as \\xNN, cut to `limit` chars.

    An empty string (a token that completes a multi-byte character later) shows as "∅".
    """
    if text == "":
        return "∅"
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        elif ch == "\ufffd":
            out.append("�")  # an incomplete UTF-8 byte sequence decoded on its own
        else:
            out.append(ch)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def escape_html(text: str) -> str:
    """`text` safe inside Qt rich text (quotes left as they are: no attribute holds it)."""
    return html.escape(text, quote=False)
