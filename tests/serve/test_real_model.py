"""The packaged SmolLM2 behind `kvscope serve`: what the official client streams is what
`engine generate` prints (slow: loads the real model twice)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_streamed_greedy_reply_of_the_real_model_equals_engine_generate(default_loaded):
    from engine.serve.server import BackgroundServer

    prompt = "What is the capital of France?"
    cli = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--temperature", "0",
         "--max-new-tokens", "32", "--device", "cpu", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    expected = json.loads(cli.stdout)
    with (
        BackgroundServer(EngineConfig(), loaded=default_loaded) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600) as client,
    ):
        stream = client.chat.completions.create(
            model=server.bridge.model_name, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=32, stream=True, logprobs=True, top_logprobs=5,
        )  # fmt: skip
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"] and "Paris" in text
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(expected["token_ids"])
    assert all(e.token == e.top_logprobs[0].token for e in entries)  # greedy: the likeliest each time
