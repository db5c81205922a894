"""Streaming detokenization with the real SmolLM2 tokenizer: multi-byte characters split across
tokens, code, special tokens, every prompt/reply split, and stop strings."""

from __future__ import annotations

import pytest

from engine.text.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = {
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "Hi 😀👍🏽 family: 👨‍👩‍👧 and flags 🇯🇵🇫🇷!",
    "code": 'def f(x):\n    return {"a": x ** 2}  # squares\n\n\tprint(f(3))\n',
    "mixed": "Résumé: naïve café — 東京 🗼, ½ ≠ ∞.  Double  spaces\n",
}


def stream(tokenizer, ids, prompt_ids=(), stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    deltas = [detok.push(t) for t in ids]
    return detok, deltas, detok.flush()


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", TEXTS)
def test_deltas_add_up_to_the_full_decode(default_tokenizer, name):
    ids = default_tokenizer.encode(TEXTS[name], add_special_tokens=False)
    expected = decode(default_tokenizer, ids)
    assert expected == TEXTS[name]
    detok, deltas, tail = stream(default_tokenizer, ids)
    assert "".join(deltas) == expected
    assert tail == ""  # nothing incomplete was left at the end
    assert detok.text == expected
    assert not detok.stopped


@pytest.mark.parametrize("name", ["chinese", "emoji"])
def test_split_characters_are_held_until_complete(default_tokenizer, name):
    ids = default_tokenizer.encode(TEXTS[name], add_special_tokens=False)
    assert len(ids) > len(TEXTS[name].encode("utf-8")) / 4, "the text must split characters across tokens"
    detok = IncrementalDetokenizer(default_tokenizer)
    held = 0
    for i, token in enumerate(ids, 1):
        delta = detok.push(token)
        held += delta == ""
        assert REPLACEMENT_CHAR not in delta
        # The streamed text is all of the reply so far once its last character is complete,
        # and a prefix of it while a character is cut (the token holding the cut is held whole).
        so_far = decode(default_tokenizer, ids[:i])
        if so_far.endswith(REPLACEMENT_CHAR):
            assert so_far.startswith(detok.text)
        else:
            assert detok.text == so_far
    assert held > 0


@pytest.mark.parametrize("name", TEXTS)
def test_every_prompt_reply_split(default_tokenizer, name):
    ids = default_tokenizer.encode(TEXTS[name], add_special_tokens=False)
    splits = 0
    for k in range(len(ids) + 1):
        prompt, reply = ids[:k], ids[k:]
        if REPLACEMENT_CHAR in decode(default_tokenizer, prompt) + decode(default_tokenizer, reply):
            continue  # the split cuts a character in two: neither side is text on its own
        splits += 1
        _, deltas, tail = stream(default_tokenizer, reply, prompt_ids=prompt)
        assert "".join(deltas) + tail == decode(default_tokenizer, reply), k
    assert splits >= len(TEXTS[name]) // 3


def test_chat_prompt_and_special_tokens(default_tokenizer):
    messages = [{"role": "user", "content": "Say hi in Chinese"}]
    prompt = default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    reply = default_tokenizer.encode("你好！😀", add_special_tokens=False)
    im_end = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = reply[:3] + [im_end] + reply[3:] + [im_end]
    detok, deltas, tail = stream(default_tokenizer, ids, prompt_ids=prompt)
    assert "".join(deltas) + tail == decode(default_tokenizer, ids) == "你好！😀"


def test_incomplete_character_at_the_end_is_released_by_flush(default_tokenizer):
    ids = default_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # drop the emoji's last byte
    detok, deltas, tail = stream(default_tokenizer, ids)
    assert "".join(deltas) == "ok"
    assert tail.endswith(REPLACEMENT_CHAR)
    assert "".join(deltas) + tail == decode(default_tokenizer, ids)
    assert detok.flush() == ""


def stop_run(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    streamed = []
    for token in ids:
        streamed.append(detok.push(token))
        if detok.stopped:
            break
    return detok, streamed, detok.flush()


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world. STOP here and more", ("STOP",), "Hello world. "),
        ("Line one\n\nLine two", ("\n\n",), "Line one"),
        ("答案是四十二。然后停止在这里", ("停止",), "答案是四十二。然后"),
        ("x = 1\n```\nmore code", ("```",), "x = 1\n"),
        ("a b c END d END", ("END", "c E"), "a b "),  # the earliest stop string wins
        ("The end is near", ("<|user|>",), "The end is near"),
    ],
)
def test_stop_strings_cut_the_text_and_never_leak(default_tokenizer, text, stop, expected):
    detok, streamed, tail = stop_run(default_tokenizer, text, stop)
    assert "".join(streamed) + tail == expected == detok.text
    assert detok.stopped == (expected != text)
    # No prefix of the streamed text ever ran past the final text (so no part of a stop string).
    so_far = ""
    for delta in streamed:
        so_far += delta
        assert expected.startswith(so_far)


def test_a_held_stop_prefix_is_released_when_it_does_not_complete(default_tokenizer):
    detok = IncrementalDetokenizer(default_tokenizer, stop=("ENDING",))
    ids = default_tokenizer.encode("THE END", add_special_tokens=False)
    streamed = "".join(detok.push(t) for t in ids)
    assert streamed == "THE "  # "END" might still become "ENDING"
    assert detok.flush() == "END"
    assert detok.text == "THE END" and not detok.stopped


def test_pushes_after_a_stop_add_nothing(default_tokenizer):
    detok, _, _ = stop_run(default_tokenizer, "yes. no", (".",))
    assert detok.stopped and detok.text == "yes"
    assert detok.push(default_tokenizer.encode(" more", add_special_tokens=False)[0]) == ""
    assert detok.text == "yes"
