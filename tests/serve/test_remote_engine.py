"""The app's remote client (app.remote.engine, no Qt) against a real `kvscope serve`: ids among other
clients, cancellation freeing the server's blocks, refusals in the server's words, shutdown."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from app.remote.engine import RemoteEngine
from app.remote.records import RemoteAttached
from app.remote.target import RemoteTarget
from engine.config import EngineConfig, SamplingParams
from engine.events import BlockEvent, RequestFailed, RequestFinished, RequestStarted, TokenGenerated
from engine.request import Request
from live.state import LiveState


@pytest.fixture(scope="module")
def server(tiny_loaded):
    from engine.serve.server import BackgroundServer

    with BackgroundServer(EngineConfig(block_size=4, num_blocks=256), loaded=tiny_loaded) as srv:
        yield srv


class Sink(list):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def __call__(self, item):
        with self.lock:
            self.append(item)

    def of(self, kind, request_id=None):
        with self.lock:
            return [
                e for e in self if isinstance(e, kind) and (request_id is None or e.request_id == request_id)
            ]


def wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture(params=[True, False], ids=["kvscope-events", "plain-openai"])
def remote(request, server):
    events, records = Sink(), Sink()
    engine = RemoteEngine(RemoteTarget.parse(server.url), events, records, use_events=request.param)
    engine.start()
    assert engine.wait_until_loaded(30)
    yield engine, events, records
    engine.shutdown(10)
    assert not engine.is_alive()


def long_request(tokens=400) -> Request:
    return Request.chat(
        "Keep going.", sampling=SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    )


def test_own_requests_keep_their_ids_among_other_clients(remote, server):
    engine, events, records = remote
    assert isinstance(records[0], RemoteAttached)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as other:
        foreign = threading.Thread(
            target=lambda: other.chat.completions.create(
                model="tiny-random-llama",
                messages=[{"role": "user", "content": "Someone else"}],
                max_tokens=20,
            )
        )
        foreign.start()
        mine = engine.submit(
            Request.chat("Mine", sampling=SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
        )
        wait(lambda: events.of(RequestFinished, mine))
        foreign.join(60)
    assert len(events.of(TokenGenerated, mine)) == 12
    if engine.source.events:
        wait(lambda: len(events.of(RequestFinished)) >= 2)
        ids = {e.request_id for e in events.of(RequestStarted)}
        assert mine in ids and len(ids) == 2  # the other client's request has an id of its own
        live = LiveState()
        live.apply(list(events))
        assert not list(live.errors) and live.page_map.num_blocks == 256
        assert {e.seq_id for e in events.of(BlockEvent) if e.seq_id is not None} <= ids
    else:  # a plain server: only this client's replies exist
        assert {e.request_id for e in events.of(RequestStarted)} == {mine}


def test_cancel_closes_the_stream_and_the_server_frees_the_blocks(remote, server):
    engine, events, _ = remote
    rid = engine.submit(long_request())
    wait(lambda: len(events.of(TokenGenerated, rid)) >= 3)
    engine.cancel(rid)
    wait(lambda: events.of(RequestFinished, rid))
    (done,) = events.of(RequestFinished, rid)
    assert done.finish_reason == "cancelled" and done.text
    wait(lambda: server.bridge.engine._call(lambda core: core.kv.pool.num_used).result(10) == 0)


def test_a_refused_request_fails_with_the_servers_words(remote):
    engine, events, _ = remote
    rid = engine.submit(Request.chat("hi", sampling=SamplingParams(max_new_tokens=5000)))
    wait(lambda: events.of(RequestFailed, rid))
    assert "context holds 2048 tokens" in events.of(RequestFailed, rid)[0].message
    assert not events.of(RequestFinished, rid)


def test_shutdown_cancels_what_is_in_flight(server):
    events = Sink()
    engine = RemoteEngine(RemoteTarget.parse(server.url), events, lambda r: None)
    engine.start()
    engine.wait_until_loaded(30)
    rid = engine.submit(long_request())
    wait(lambda: events.of(TokenGenerated, rid))
    engine.shutdown(10)
    assert not engine.is_alive()
    wait(lambda: server.bridge.engine._call(lambda core: core.kv.pool.num_used).result(10) == 0)
    with pytest.raises(RuntimeError, match="not connected"):
        engine.submit(long_request())


def test_a_reply_cancelled_at_once_still_ends(remote, server):
    engine, events, _ = remote
    rid = engine.submit(long_request())
    engine.cancel(rid)  # before, while or after the request reaches the server: it must end
    wait(lambda: events.of(RequestFinished, rid) or events.of(RequestFailed, rid))
    (done,) = events.of(RequestFinished, rid)
    assert done.finish_reason == "cancelled"
    wait(lambda: server.bridge.engine._call(lambda core: core.kv.pool.num_used).result(10) == 0)
