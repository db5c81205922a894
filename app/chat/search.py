"""Full-text search of conversations: what the user types, made safe for SQLite FTS5, and the
hits as the sidebar lists them.

Typed text is never FTS5 syntax: each word becomes a quoted phrase (so `"`, `-`, `AND`, `*`,
`:` are just characters), all words must occur, and the last word matches as a prefix so the
results follow the typing.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

# snippet() marks the matched words with these control characters; they become <b> after the
# rest of the snippet is escaped (a message's own text can never inject markup).
MATCH_START, MATCH_END = "\x02", "\x03"


@dataclass(frozen=True, slots=True)
class SearchHit:
    conversation_id: int
    title: str
    message_id: int
    role: str
    snippet: str  # HTML: escaped text with the matched words in <b>


def match_query(text: str) -> str:
    """'kv cach' -> '"kv" "cach"*'; '' for text with no words."""
    words = [w.replace('"', '""') for w in text.split()]
    words = [w for w in words if w.strip('"')]
    if not words:
        return ""
    quoted = [f'"{w}"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


def like_pattern(word: str) -> str:
    """A LIKE pattern matching `word` anywhere (for an SQLite without FTS5), ESCAPE '\\'."""
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def snippet_html(snippet: str, limit: int = 160) -> str:
    text = " ".join(snippet.split())
    if len(text) > limit and MATCH_START not in text:
        text = text[:limit] + "…"
    return html.escape(text).replace(MATCH_START, "<b>").replace(MATCH_END, "</b>")
