"""End to end: the real packaged SmolLM2 through the app's own scripted path.

`python -m app --prompt ... --screenshot ... --quit-after-reply` in a fresh process (offscreen
Qt, isolated user dirs): it must load the model, stream a reply through the chat, store it, save
a screenshot of the whole window and exit 0.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The first run converts the packaged GGUF (about a minute on a small CPU); later runs reuse it.
RUN_TIMEOUT_S = 900
PROMPT = "Name three colours of the rainbow."


@pytest.mark.slow
def test_scripted_prompt_reply_and_screenshot(tmp_path):
    shot = tmp_path / "kvscope.png"
    env = {
        **os.environ,
        "QT_QPA_PLATFORM": "offscreen",
        "KVSCOPE_DATA_DIR": str(tmp_path / "data"),
        "KVSCOPE_CONFIG_DIR": str(tmp_path / "config"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "app", "--prompt", PROMPT, "--screenshot", str(shot), "--quit-after-reply"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"screenshot saved to {shot}" in result.stderr

    from PySide6.QtGui import QImage

    image = QImage(str(shot))
    # the whole window, at least the smallest screen the layout is made for (960x540 logical;
    # the offscreen platform's screen is 800x600, so the window stands at its minimum width)
    assert not image.isNull() and image.width() >= 900 and image.height() >= 533
    colours = {image.pixel(x, y) for x in range(0, image.width(), 37) for y in range(0, image.height(), 29)}
    assert len(colours) > 50  # a drawn window, not a blank frame

    db = sqlite3.connect(tmp_path / "data" / "conversations.sqlite3")
    rows = db.execute("SELECT role, content, finish_reason, model FROM messages ORDER BY id").fetchall()
    assert rows[0][:2] == ("user", PROMPT)
    role, reply, finish_reason, model = rows[1]
    assert role == "assistant" and reply.strip() and finish_reason in ("stop", "length")
    assert model == "SmolLM2-135M-Instruct"
