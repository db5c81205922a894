"""A real uvicorn on a free loopback port, serving the tiny model, for the official `openai` client."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.fixture(scope="module")
def server(tiny_loaded):
    from engine.serve.server import BackgroundServer

    with BackgroundServer(EngineConfig(block_size=4, num_blocks=512), loaded=tiny_loaded) as srv:
        yield srv


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
