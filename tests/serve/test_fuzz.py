"""Schemathesis against the server's own OpenAPI schema, bounded to a minute here (`./dev fuzz`
runs it for ten): no 5xx, every response a status, content type and body the schema names."""

from __future__ import annotations

import httpx

from engine.config import EngineConfig
from engine.serve.fuzz import CHECKS, FUZZ_CONTEXT, run_schemathesis

FUZZ_TEST_S = 60


def test_the_server_holds_to_its_own_schema(tiny_loaded):
    from engine.serve.server import BackgroundServer

    config = EngineConfig(block_size=4, num_blocks=256, max_model_len=FUZZ_CONTEXT, max_num_seqs=8)
    with BackgroundServer(config, loaded=tiny_loaded) as server:
        schema = httpx.get(server.url + "/openapi.json").json()
        summary = run_schemathesis(server.url, FUZZ_TEST_S)
        assert httpx.get(server.url + "/health").status_code == 200, "the server survived it"
        used = server.bridge.engine._call(lambda core: core.kv.pool.num_used).result(30)
    print(summary.line())
    assert summary.failures == 0 and summary.exit_code == 0, "\n".join(summary.failure_lines)
    assert summary.operations == 5 and summary.test_cases > 100 and summary.checks == CHECKS
    assert used == 0, "every fuzzed request gave its blocks back"
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "422", "429", "500", "503"} <= set(chat)
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    request = schema["components"]["schemas"]["ChatRequest"]["properties"]
    assert request["model"]["anyOf"][0]["enum"] == ["tiny-random-llama"]
    assert request["n"]["maximum"] == 8 and request["max_tokens"]["anyOf"][0]["maximum"] == FUZZ_CONTEXT
