"""Figures that mean what their names say (issue 24): inter-token latency is one gap per engine
step, as vLLM's, also when a speculative round gives several tokens at once; a request's time
splits into queueing and prefill (llama.cpp's `prompt_ms` is the prefill); on CUDA the forward
is timed by the device's events, synchronized (a fake CUDA module here)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.core.step_clock import DeviceClock
from engine.events import RequestFinished, SpecRound, StepStats, TokenGenerated
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.serve.metrics import ServeMetrics
from engine.serve.replies import timings

VOCAB = 300


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=9, num_hidden_layers=4, tie_word_embeddings=False)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


def run(engine, prompts, params):
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in prompts]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return ids, steps


def test_itl_is_one_gap_per_step_under_speculative_decoding(tiny):
    events: list = []
    engine = LLMEngine(
        tiny,
        EngineConfig(block_size=4, num_blocks=200, speculative=SpeculativeConfig("ngram", num_draft=4)),
        events.append,
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    (rid,), _ = run(engine, [[5, 6, 7, 8] * 8], greedy)
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert any(len(r.emitted) > 1 for r in rounds), "some round gave several tokens"
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    step_times = sorted({t.t for t in tokens})
    assert len(step_times) < len(tokens), "a round's tokens share their step's time"
    assert len(done.stats.itl_s) == len(step_times) - 1 and all(gap > 0 for gap in done.stats.itl_s)
    # the server's histogram: one observation per step, none of the round's zero gaps
    metrics = ServeMetrics("tiny")
    metrics.arrived(rid, tokens[0].t - 0.01)
    for event in events:
        metrics.observe(event)
    text = metrics.text().decode()
    count = next(
        line for line in text.splitlines() if line.startswith("kvscope:inter_token_latency_seconds_count")
    )
    assert float(count.split()[-1]) == len(step_times) - 1
    # tokens/s counts every token after the first over the first-to-last step time
    span = step_times[-1] - step_times[0]
    assert done.stats.tokens_per_s == pytest.approx((len(tokens) - 1) / span)


def test_ttft_splits_into_queueing_and_prefill_and_prompt_ms_is_the_prefill(tiny):
    """One sequence at a time: the second request waits for the first to finish, so its TTFT
    is mostly queueing, and llama.cpp's prompt_ms (prompt processing) must not count that."""
    events: list = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=200, max_num_seqs=1), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    (first, second), _ = run(engine, [list(range(10, 30)), list(range(40, 60))], params)
    done = {e.request_id: e.stats for e in events if isinstance(e, RequestFinished)}
    for stats in done.values():
        assert stats.queued_s + stats.prefill_s == pytest.approx(stats.ttft_s, abs=1e-9)
    waited = done[second]
    assert waited.queued_s > waited.prefill_s > 0, "it waited for the whole first reply"
    body = timings([waited])
    assert (
        body["prompt_ms"] == pytest.approx(waited.prefill_s * 1000)
        and body["prompt_ms"] < waited.ttft_s * 1000
    )
    assert body["predicted_per_token_ms"] == pytest.approx(
        sum(waited.itl_s) * 1000 / (waited.generated_tokens - 1)
    )


class FakeEvent:
    """torch.cuda.Event's surface: the device clock reads `at` when recorded."""

    device_now_ms = 0.0
    log: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing, "events must time"
        self.at: float | None = None
        self.synchronized = False

    def record(self):
        self.at = FakeEvent.device_now_ms
        FakeEvent.log.append(("record", self))

    def synchronize(self):
        self.synchronized = True
        FakeEvent.log.append(("synchronize", self))

    def elapsed_time(self, end):
        assert end.synchronized, "reading an unsynchronized event is the launch's time, not the work's"
        return end.at - self.at


class FakeCuda:
    Event = FakeEvent


def test_the_forward_is_timed_by_synchronized_cuda_events():
    clock = DeviceClock(torch.device("cuda"), cuda=FakeCuda)
    assert clock.synchronizes
    FakeEvent.log.clear()
    FakeEvent.device_now_ms = 100.0
    mark = clock.start()
    FakeEvent.device_now_ms = 137.5  # the device worked 37.5 ms, whatever the wall clock says
    assert clock.stop(mark) == pytest.approx(0.0375)
    assert [what for what, _ in FakeEvent.log] == ["record", "record", "synchronize"]
    cpu = DeviceClock(torch.device("cpu"), cuda=FakeCuda)
    assert not cpu.synchronizes and cpu.stop(cpu.start()) >= 0.0


def test_the_engine_reports_the_devices_forward_time(tiny):
    events: list = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=200), events.append)
    engine.clock = DeviceClock(torch.device("cuda"), cuda=FakeCuda)
    real = engine.runner.forward

    def forward_taking_25_ms(*args, **kwargs):
        out = real(*args, **kwargs)
        FakeEvent.device_now_ms += 25.0
        return out

    engine.runner.forward = forward_taking_25_ms
    run(engine, [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    steps = [e for e in events if isinstance(e, StepStats)]
    assert steps and all(s.forward_s == pytest.approx(0.025) for s in steps)
