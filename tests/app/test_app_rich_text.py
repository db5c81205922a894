"""Chat text to Qt rich text: Markdown with code blocks, no injected markup, token links."""

from __future__ import annotations

import math

from pygments.token import Keyword

from app.chat.rich_text import (
    CODE_STYLE,
    PARTIAL_CHARACTER_MARK,
    ReplyToken,
    copy_index_from_link,
    markdown_html,
    plain_html,
    render_markdown,
    token_html,
    token_index_from_link,
)
from widgets import theme


def test_code_fence_becomes_a_shaded_block_with_escaped_code():
    html = markdown_html("Try:\n\n```\nif a < b:\n    print('<b>')\n```\n")
    assert f'bgcolor="{theme.CODE_BG}"' in html
    assert "if a &lt; b:\n    print(&#x27;&lt;b&gt;&#x27;)" in html  # no language: plain, escaped


def test_a_known_language_is_highlighted_by_pygments_with_inline_colours_and_a_copy_link():
    from pygments.styles import get_style_by_name

    text = "Try:\n\n```python\nif a < b:\n    print('<b>')  # done\n```\n\n```nosuchlang\nx\n```"
    html, blocks = render_markdown(text)
    assert ">python<" in html  # the language label
    keyword = get_style_by_name(CODE_STYLE).style_for_token(Keyword)["color"]
    assert f'<span style="color: #{keyword}">if</span>' in html  # Qt reads inline colours only
    assert "&lt;b&gt;" in html and "<b>" not in html.split("<pre")[1]  # code is never markup
    assert blocks == ["if a < b:\n    print('<b>')  # done", "x"]  # the Copy links' text, as written
    assert 'href="copy:0"' in html and 'href="copy:1"' in html
    assert copy_index_from_link("copy:1") == 1 and copy_index_from_link("tok:1") is None


def test_copy_link_puts_the_code_on_the_clipboard(qtbot):
    from PySide6.QtGui import QGuiApplication

    from app.chat.bubble import MessageBubble

    bubble = MessageBubble("assistant", "model")
    qtbot.addWidget(bubble)
    bubble.set_text("Run:\n\n```bash\necho 'hi' && ls\n```")
    with qtbot.waitSignal(bubble.code_copied) as copied:
        bubble._body.linkActivated.emit("copy:0")
    assert copied.args == [0]
    assert QGuiApplication.clipboard().text() == "echo 'hi' && ls"


def test_unfinished_fence_mid_stream_still_renders_as_code():
    html, blocks = render_markdown("```js\nconst x = 1")
    assert f'bgcolor="{theme.CODE_BG}"' in html and blocks == ["const x = 1"]
    assert ">const<" in html  # highlighted as far as it goes


def test_markdown_emphasis_lists_and_tables():
    html = markdown_html("**bold** and `code`\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |")
    assert "<strong>bold</strong>" in html
    assert "<code" in html and "code" in html
    assert html.count("<li>") == 2
    assert "<table>" in html and "<td>2</td>" in html


def test_raw_html_from_the_model_is_shown_not_interpreted():
    html = markdown_html('<a href="http://x">click</a><script>alert(1)</script>')
    assert "<a href" not in html and "<script>" not in html
    assert "&lt;script&gt;" in html


def test_user_text_is_escaped_and_keeps_its_lines():
    assert plain_html("a <b>\n  c") == '<p style="white-space: pre-wrap;">a &lt;b&gt;\n  c</p>'


def test_token_view_links_every_token_and_marks_partial_characters():
    tokens = [
        ReplyToken(0, "Hello", math.log(0.95)),
        ReplyToken(1, "", math.log(0.5)),  # first half of a multi-byte character
        ReplyToken(2, " 世", math.log(0.05)),
    ]
    html = token_html(tokens, selected=2, colour_by_probability=True)
    assert [token_index_from_link(f"tok:{i}") for i in range(3)] == [0, 1, 2]
    for i in range(3):
        assert f'href="tok:{i}"' in html
    assert PARTIAL_CHARACTER_MARK in html
    assert theme.SELECTED_TOKEN_BG in html  # the selected token wins over its probability colour
    assert theme.probability_background(0.5) in html  # the partial token's colour
    assert "background-color" not in html.split('href="tok:1"')[0]  # p = 0.95: unmarked


def test_token_links_only_parse_token_links():
    assert token_index_from_link("tok:17") == 17
    assert token_index_from_link("tok:x") is None
    assert token_index_from_link("http://example.com") is None


def test_probability_scale_is_monotonic():
    shades = [theme.probability_background(p) for p in (0.99, 0.7, 0.4, 0.2, 0.01)]
    assert shades[0] is None and len(set(shades)) == 5
