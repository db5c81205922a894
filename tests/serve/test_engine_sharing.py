"""What the HTTP layer must leave to the engine: concurrent clients batched into the same steps,
a disconnect cancelling the request and freeing its blocks, metrics and the events stream."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL, EventsListener, chat, pool_used, wait_for

from engine.events import RequestFinished, SpecRound, StepStats

VLLM_NAMES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_preemptions",
    "request_success", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_inference_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
)  # fmt: skip


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser, by name (+ labels)."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_four_concurrent_clients_share_engine_steps(server):
    barrier, results = threading.Barrier(4), {}

    def client_run(i: int) -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            barrier.wait()
            stream = client.chat.completions.create(
                model=MODEL, messages=chat(f"Client {i} speaking."), max_tokens=40, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with EventsListener(server.url) as listener:
        threads = [threading.Thread(target=client_run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wait_for(lambda: len(listener.of(RequestFinished)) >= 4, what="four finished requests")
    assert len(results) == 4 and all(results.values())
    steps = listener.of(StepStats)
    # One forward served all four clients: the engine batched them like chat tabs.
    shared = [s for s in steps if s.num_seqs == 4 and s.decode_tokens == 4]
    assert shared, f"no step ran the four requests together: {[s.num_seqs for s in steps]}"
    assert max(s.running for s in steps) == 4


def test_a_disconnect_mid_stream_cancels_and_frees_the_blocks(server, client):
    before = metrics(server).get("kvscope:request_success_total{finished_reason=abort}", 0.0)
    stream = client.chat.completions.create(
        model=MODEL, messages=chat("Talk for a long time."), max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    assert pool_used(server) > 0  # the reply holds its blocks while it streams
    stream.close()  # the client goes away mid-reply
    wait_for(lambda: pool_used(server) == 0, what="the blocks to be freed")
    wait_for(
        lambda: (
            metrics(server).get("kvscope:request_success_total{finished_reason=abort}", 0.0) == before + 1
        ),
        what="the cancellation to be counted",
    )


def test_a_disconnect_while_waiting_for_a_whole_response_cancels_it(server):
    before = metrics(server).get("kvscope:request_success_total{finished_reason=abort}", 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": chat("Go on and on."), "max_tokens": 1500, "ignore_eos": True},
            timeout=httpx.Timeout(30, read=0.5),
        )
    wait_for(lambda: pool_used(server) == 0, what="the blocks of the abandoned request to be freed")
    # cancelled, not run to its 1500 tokens: the server noticed the client had gone
    wait_for(
        lambda: (
            metrics(server).get("kvscope:request_success_total{finished_reason=abort}", 0.0) == before + 1
        ),
        what="the cancellation to be counted",
    )


def test_metrics_parse_and_count_what_the_engine_did(server, client):
    before = metrics(server)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat("Measure me."),
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = metrics(server)
    names = {name.split("{")[0] for name in after}
    for name in VLLM_NAMES:
        family = "kvscope:" + name
        assert any(n == family or n.startswith(family + "_") for n in names), f"{family} missing"

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvscope:generation_tokens_total") == 7
    assert delta("kvscope:prompt_tokens_total") == reply.usage.prompt_tokens
    assert delta("kvscope:time_to_first_token_seconds_count") == 1
    assert delta("kvscope:inter_token_latency_seconds_count") == 6
    assert delta("kvscope:e2e_request_latency_seconds_count") == 1
    assert delta("kvscope:request_success_total{finished_reason=length}") == 1
    for phase in ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token"):
        assert delta(f"kvscope:request_{phase}_seconds_count") == 1
    assert delta("kvscope:request_generation_tokens_sum") == 7
    assert delta("kvscope:request_prompt_tokens_sum") == reply.usage.prompt_tokens
    assert delta("kvscope:request_params_max_tokens_sum") == 7 and delta("kvscope:request_params_n_sum") == 1
    assert delta("kvscope:prefix_cache_queries_total") == reply.usage.prompt_tokens
    assert delta("kvscope:prefix_cache_hits_total") == reply.usage.prompt_tokens_details.cached_tokens
    assert 0.0 <= after["kvscope:kv_cache_usage_perc"] <= 1.0
    assert after["kvscope:num_requests_running"] == 0 and after["kvscope:num_requests_waiting"] == 0


@pytest.fixture(scope="module")
def speculative_server(tiny_loaded):
    from engine.config import EngineConfig, SpeculativeConfig
    from engine.serve.server import BackgroundServer

    config = EngineConfig(block_size=4, num_blocks=256, speculative=SpeculativeConfig("ngram", num_draft=3))
    with BackgroundServer(config, loaded=tiny_loaded) as srv:
        yield srv


def test_spec_decode_counters_equal_the_engine_rounds(speculative_server):
    with (
        EventsListener(speculative_server.url) as listener,
        openai.OpenAI(base_url=speculative_server.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        client.chat.completions.create(
            model=MODEL, messages=chat("one two three one two three one two three"), max_tokens=30, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        wait_for(lambda: listener.of(RequestFinished), what="the request's end on the events stream")
        rounds = listener.of(SpecRound)
    m = metrics(speculative_server)
    assert rounds and m["kvscope:spec_decode_num_drafts_total"] == len(rounds)
    assert m["kvscope:spec_decode_num_draft_tokens_total"] == sum(len(r.draft_ids) for r in rounds)
    assert m["kvscope:spec_decode_num_accepted_tokens_total"] == sum(r.accepted for r in rounds)


def page_state(events) -> dict[str, np.ndarray]:
    from live.state import LiveState

    live = LiveState()
    live.apply(events)
    pm = live.page_map
    assert not [e for e in live.errors if e.startswith("page map")], list(live.errors)
    return {
        "ref": pm.ref_count.copy(),
        "fill": pm.fill.copy(),
        "cached": pm.cached.copy(),
        "start": pm.token_start.copy(),
    }


def test_the_events_stream_rebuilds_the_page_map_exactly(server, client):
    def pool_state(core):
        blocks = core.kv.pool.blocks
        return {
            "ref": np.array([b.ref_cnt for b in blocks]),
            "fill": np.array([b.num_tokens for b in blocks]),
            "cached": np.array([b.block_hash is not None for b in blocks]),
        }

    system = "You answer in one word, always, without exception, whatever the question is. " * 4
    with EventsListener(server.url) as early:
        # a finished request leaves cached prefix blocks; a second one shares them while it streams
        client.chat.completions.create(model=MODEL, messages=chat("First?", system), max_tokens=3)
        stream = client.chat.completions.create(
            model=MODEL, messages=chat("Second?", system), max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        with EventsListener(server.url) as late:  # joins mid-reply: starts from a snapshot
            wait_for(lambda: len(late.all()) > 50, what="events after the snapshot")
            stream.close()
            wait_for(lambda: pool_used(server) == 0, what="the reply to be cancelled")
            truth = server.bridge.engine._call(pool_state).result(10)
            wait_for(lambda: page_state(late.all())["ref"].sum() == 0, what="the late stream to see the free")
            wait_for(
                lambda: page_state(early.all())["ref"].sum() == 0, what="the early stream to see the free"
            )
            late_state, early_state = page_state(late.all()), page_state(early.all())
    for key in ("ref", "fill", "cached"):
        assert np.array_equal(late_state[key], truth[key]), key
        assert np.array_equal(early_state[key], truth[key]), key
    assert truth["cached"].sum() > 0  # the test saw cached prefix blocks, not just an empty pool
    cached = truth["cached"]
    assert np.array_equal(late_state["start"][cached], early_state["start"][cached])
    assert late.hello["server"] == "kvscope" and late.hello["model"] == MODEL


def test_a_tagged_request_is_named_on_the_events_stream_before_it_starts(server, client):
    from engine.events import RequestStarted
    from engine.serve.codec import RequestTagged

    with EventsListener(server.url) as listener:
        client.chat.completions.create(
            model=MODEL, messages=chat("Tagged."), max_tokens=2, extra_body={"kvscope": {"tag": "abc123"}}
        )
        wait_for(lambda: listener.of(RequestFinished), what="the tagged request's end")
        events = listener.all()
    (tagged,) = [e for e in events if isinstance(e, RequestTagged)]
    started = next(e for e in events if isinstance(e, RequestStarted))
    assert tagged.tag == "abc123" and started.request_id == tagged.request_id
    assert events.index(tagged) < events.index(started)
