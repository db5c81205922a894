"""The remote client's pure parts: targets, each server's /metrics, and a generic server's
streamed chunks turned into the engine's events (canned payloads in each server's format)."""

from __future__ import annotations

import math

import pytest

from app.remote.openai_stream import UNKNOWN_TOKEN_ID, ReplyAdapter
from app.remote.prom import family_of, parse, point_between
from app.remote.target import RemoteSource, RemoteTarget, TargetError
from engine.events import RequestFinished, TokenGenerated
from live.remote import REMOTE_TOP_K, is_remote_snapshot

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 64.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="smol"} GEN
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="smol"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smol"} TTFT_N
vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"} TTFT_N
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smol"} TTFT_S
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="smol"} 10.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="smol"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="smol"} 0.5
"""

LLAMACPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total PRED
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total SECS
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.1
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{model_name="m"} 90.0
"""


def vllm(gen: float, ttft_n: float, ttft_s: float) -> str:
    return VLLM.replace("GEN", str(gen)).replace("TTFT_N", str(ttft_n)).replace("TTFT_S", str(ttft_s))


def test_targets_are_normalised_or_refused_with_a_reason():
    assert RemoteTarget.parse("127.0.0.1:8000").url == "http://127.0.0.1:8000"
    assert RemoteTarget.parse(" https://gpu.example/llm/v1/ ", "k").url == "https://gpu.example/llm"
    assert RemoteTarget.parse("http://h:1", "  ").api_key is None
    assert RemoteTarget.parse("http://h:1", "key").headers() == {"Authorization": "Bearer key"}
    assert RemoteTarget.parse("http://h:8000").label == "h:8000"
    for bad, why in (
        ("", "enter the server's URL"),
        ("ftp://h", "http:// or https://"),
        ("http://h:99999", "bad port"),
    ):
        with pytest.raises(TargetError, match=why):
            RemoteTarget.parse(bad)


def test_each_servers_metrics_are_recognised():
    assert family_of(vllm(1, 1, 1)) == "vllm"
    assert family_of(LLAMACPP.replace("PRED", "1").replace("SECS", "1")) == "llamacpp"
    assert family_of(SGLANG) == "sglang"
    assert family_of("kvscope:kv_cache_usage_perc 0.5\n") == "kvscope"
    assert family_of("# just comments\nother_metric 1\n") == ""


def test_vllm_metrics_become_rates_and_means_over_the_poll_interval():
    before = parse(vllm(300, 2, 0.5), t=10.0)
    after = parse(vllm(340, 4, 1.5), t=12.0)
    assert after.family == "vllm" and after.get("kv_usage") == 0.25 and after.get("running") == 2.0
    point = point_between(before, after)
    assert point.tokens_per_s == pytest.approx(20.0)  # 40 tokens in 2 s
    assert point.ttft_s == pytest.approx(0.5)  # two first tokens, 1.0 s between them
    assert point.itl_s is None  # the ITL histogram did not move
    assert point.prefix_hit_rate == pytest.approx(0.64)
    restarted = point_between(after, parse(vllm(5, 0, 0), t=13.0))
    assert restarted.tokens_per_s is None  # a counter that went down: the server restarted


def test_llamacpp_itl_is_its_predicting_time_over_its_tokens():
    text = LLAMACPP.replace("PRED", "{p}").replace("SECS", "{s}")
    before = parse(text.format(p=40, s=2.0), t=0.0)
    after = parse(text.format(p=60, s=3.0), t=2.0)
    point = point_between(before, after)
    assert point.tokens_per_s == pytest.approx(10.0) and point.itl_s == pytest.approx(0.05)
    assert point.kv_usage is None and point.ttft_s is None  # it exports neither


def test_sglang_usage_and_queue():
    sample = parse(SGLANG, t=0.0)
    assert sample.get("kv_usage") == 0.1 and sample.get("running") == 3.0 and sample.get("waiting") == 0.0


def chunk(index, content, entries=None, finish=None, usage=None):
    choice = {"index": index, "delta": {"content": content}, "finish_reason": finish}
    if entries is not None:
        choice["logprobs"] = {"content": entries}
    out = {"choices": [choice]}
    if usage:
        out = {"choices": [], "usage": usage}
    return out


def entry(token, logprob, top=()):
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
    }


def test_a_streamed_reply_becomes_token_events_timed_on_the_client():
    adapter = ReplyAdapter(7, t_sent=100.0)
    assert adapter.started().t == 100.0
    events = adapter.feed(chunk(0, "Hel", [entry("Hel", -0.1, [("Hel", -0.1), ("Hi", -2.5)])]), t=100.4)
    # two tokens in one chunk (a server that batches its stream), then the end and the usage
    events += adapter.feed(
        chunk(0, "lo!", [entry("lo", -0.2, [("lo", -0.2)]), entry("!", -3.0, [("?", -0.1)])]), t=100.5
    )
    events += adapter.feed(chunk(0, "", finish="length"), t=100.6)
    adapter.feed(chunk(0, "", usage={"prompt_tokens": 9, "completion_tokens": 3,
                                     "prompt_tokens_details": {"cached_tokens": 8}}), t=100.6)  # fmt: skip
    assert all(isinstance(e, TokenGenerated) for e in events)
    assert [(e.index, e.text, e.text_delta) for e in events] == [
        (0, "Hel", "Hel"),
        (1, "lo", "lo"),
        (2, "!", "!"),
    ]
    assert all(e.token_id == UNKNOWN_TOKEN_ID for e in events)
    snap = events[0].snapshot
    assert is_remote_snapshot(snap) and snap.stages[0].name == REMOTE_TOP_K
    assert snap.candidate_texts == ("Hel", "Hi") and snap.drawn_id == snap.candidate_ids[0]
    assert snap.stages[0].probs == pytest.approx((math.exp(-0.1), math.exp(-2.5)))
    sampled_outside = events[2].snapshot  # "!" was drawn though "?" was likelier: shown after it
    assert sampled_outside.candidate_texts == ("?", "!") and sampled_outside.drawn_id == -2
    done = adapter.finished(t=100.7)
    assert isinstance(done, RequestFinished) and done.text == "Hello!" and done.finish_reason == "length"
    s = done.stats
    assert s.prompt_tokens == 9 and s.cached_prompt_tokens == 8 and s.generated_tokens == 3
    assert s.ttft_s == pytest.approx(0.4) and s.itl_s == pytest.approx((0.1, 0.0))
    assert len(done.token_ids) == 3


def test_a_server_without_logprobs_gives_a_token_per_chunk_and_no_snapshot():
    adapter = ReplyAdapter(1, t_sent=0.0)
    events = (
        adapter.feed(chunk(0, "Hi"), t=1.0)
        + adapter.feed(chunk(0, ""), t=1.1)
        + adapter.feed(chunk(0, " there"), t=1.2)
    )
    assert [e.text_delta for e in events] == ["Hi", " there"] and events[0].snapshot is None
    assert math.isnan(events[0].logprob)
    assert adapter.finished(2.0, "cancelled").finish_reason == "cancelled"


def test_n_choices_become_branches_and_ranked_sequences():
    adapter = ReplyAdapter(3, t_sent=0.0, n=2)
    adapter.feed(chunk(0, "a", [entry("a", -1.0)]), t=1.0)
    events = adapter.feed(chunk(1, "b", [entry("b", -0.5)], finish="stop"), t=1.0)
    assert events[0].branch == 1
    done = adapter.finished(t=2.0)
    assert [s.branch for s in done.sequences] == [1, 0]  # best score first, as the engine ranks
    assert done.text == "b" and done.sequences[1].text == "a"


def test_a_kvscope_stream_is_moved_to_this_apps_ids_and_clock():
    import itertools

    from app.remote.kvscope_events import EventTranslator
    from engine.events import BeamStep, BlockEvent, RequestStarted, SequenceForked
    from engine.serve.codec import RequestTagged

    ids = itertools.count(1)
    mine = next(ids)  # what submit() returned for the request sent with tag "t1"
    tr = EventTranslator(lambda: next(ids), lambda name: f"{name} @ server")
    tr.pending["t1"] = mine
    tr.hello(server_t=1000.0, local_t=5.0)
    assert tr.translate(RequestStarted(40, 3, 1001.0)) == RequestStarted(2, 3, 6.0)  # someone else's
    assert tr.translate(RequestTagged(41, "t1", 1002.0)) is None
    assert tr.translate(RequestStarted(41, 3, 1002.0)) == RequestStarted(mine, 3, 7.0)
    fork = tr.translate(SequenceForked(41, 41, 1 << 40, 1, 3, 1003.0))
    assert (fork.request_id, fork.parent_seq_id, fork.seq_id) == (mine, mine, 3)
    assert tr.translate(BlockEvent("free", (4,), None, t=0.0)) == BlockEvent("free", (4,), None)
    beam = tr.translate(BeamStep(41, 0, (0,), (9,), ("x",), (-1.0,), (1 << 40,), t=1004.0))
    assert beam.seq_ids == (3,) and beam.t == 9.0


def vllm_batch(*events) -> bytes:
    """A batch as vLLM's ZmqEventPublisher sends it: msgspec's array-like [ts, events, dp_rank]
    with each event a map tagged by "type" (block hashes are ints or bytes)."""
    import msgpack

    return msgpack.packb([1.0, list(events), 0])


def stored(hashes, block_size=128):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(block_size * len(hashes))), "block_size": block_size,
            "lora_id": None, "medium": "GPU"}  # fmt: skip


def test_vllm_kv_events_fold_into_its_prefix_cache():
    from app.remote.vllm_kv import PrefixCacheMirror, endpoint_for

    assert endpoint_for("http://gpu-box:8000") == "tcp://gpu-box:5557"
    mirror = PrefixCacheMirror("tcp://h:5557")
    mirror.fold(vllm_batch(stored([11, 12, b"\x01\x02"])))
    mirror.fold(vllm_batch({"type": "BlockRemoved", "block_hashes": [12, 99], "medium": "GPU"}))
    state = mirror.state()
    assert (state.blocks, state.tokens, state.block_size) == (2, 256, 128)
    assert (state.stored, state.removed, state.batches) == (3, 1, 2)
    mirror.fold(vllm_batch({"type": "AllBlocksCleared"}))
    assert mirror.state().blocks == 0 and mirror.state().cleared == 1


def test_vllm_kv_events_arrive_over_zmq_and_say_so_in_the_page_map_notice():
    import asyncio

    import zmq

    from app.remote.target import RemoteSource
    from app.remote.views import notices, prefix_cache_line
    from app.remote.vllm_kv import follow

    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    states = []

    async def run():
        task = asyncio.create_task(follow(f"tcp://127.0.0.1:{port}", states.append))
        for _ in range(200):  # ZMQ's slow joiner: publish until the subscription has arrived
            publisher.send_multipart([b"", (0).to_bytes(8, "big"), vllm_batch(stored([1, 2]))])
            await asyncio.sleep(0.02)
            if len(states) > 1:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        publisher.close(0)
        context.term()
    assert states[0].batches == 0 and states[-1].blocks == 2 and states[-1].block_size == 128
    source = RemoteSource(RemoteTarget.parse("127.0.0.1:8000"), "smollm2", "vllm", False, True)
    assert "Listening for its ZMQ KV-cache events" in prefix_cache_line(source, states[0])
    text = notices(source, "", prefix_cache_line(source, states[-1]))["page_map"]
    assert "<b>2</b> blocks of 128 tokens cached (256 tokens)" in text


def test_a_model_named_by_its_path_is_shown_by_its_file_name():
    from app.remote.target import RemoteSource

    target = RemoteTarget.parse("h:8080")
    name = RemoteSource(
        target, "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "llamacpp", False, True
    ).display_name
    assert name == "SmolLM2-135M-Instruct.Q4_1 @ h:8080 (llama.cpp)"
    repo = RemoteSource(target, "HuggingFaceTB/SmolLM2-135M-Instruct", "vllm", False, True).display_name
    assert repo == "HuggingFaceTB/SmolLM2-135M-Instruct @ h:8080 (vLLM)"


def test_a_remote_request_carries_the_chats_structured_output_and_tools():
    import json

    from app.remote.http import request_body
    from engine.config import GrammarSpec, SamplingParams
    from engine.events import ToolCall
    from engine.request import ChatMessage, Request, ToolSpec

    source = RemoteSource(RemoteTarget.parse("127.0.0.1:8000"), "smollm2", "vllm", False, True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    add = ToolSpec("add", "Add", json.dumps(schema))
    call = ToolCall("add", '{"a": 1}', "call_1")
    request = Request(
        messages=(
            ChatMessage("user", "hi"),
            ChatMessage("assistant", "", tool_calls=(call,)),
            ChatMessage("tool", "2", tool_call_id="call_1"),
        ),
        tools=(add,),
        tool_choice="named",
        tool_name="add",
        sampling=SamplingParams(grammar=GrammarSpec("json_schema", json.dumps(schema))),
    )
    body = request_body(source, request, None, False)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema},
    }
    assert body["tools"][0]["function"]["parameters"] == schema
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert body["messages"][1]["content"] is None
    assert body["messages"][2] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}
    regex = Request.chat("x", sampling=SamplingParams(grammar=GrammarSpec("regex", "[0-9]+")))
    assert request_body(source, regex, None, False)["guided_regex"] == "[0-9]+"


def test_streamed_tool_call_deltas_become_the_calls_of_the_reply():
    adapter = ReplyAdapter(7, 0.0, snapshots=False)
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_x",
                                "type": "function",
                                "function": {"name": "add", "arguments": ""},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}}
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    for i, chunk in enumerate(chunks):
        adapter.feed(chunk, float(i))
    (parsed,) = adapter.tool_calls(3.0)
    assert parsed.request_id == 7 and parsed.format == "server" and not parsed.error
    assert [(c.id, c.name, c.arguments) for c in parsed.calls] == [("call_x", "add", '{"a": 1}')]
    assert adapter.finished(3.0).finish_reason == "stop"
