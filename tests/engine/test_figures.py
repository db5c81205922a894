"""Figures that mean what their names say (issue 24): inter-token latency is one gap per engine
step, as vLLM's, also when a speculative round gives several tokens at once; a request's time
splits into queueing and prefill (llama.cpp's `prompt_ms` is the prefill); on CUDA the forward
is timed by the device's events, synchronized (a fake CUDA module here); the server's per-request
histograms are vLLM's request phases and sizes, its finish reasons vLLM's."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.core.step_clock import DeviceClock
from engine.events import RequestFailed, RequestFinished, SpecRound, StepStats, TokenGenerated
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


def samples(metrics: ServeMetrics) -> dict[str, float]:
    """/metrics as prometheus-client parses it: sample name (+ labels but the model's) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "le")
            )
            if "le" not in sample.labels:
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_the_servers_request_histograms_are_vllms_request_phases(tiny):
    """A speculative run (several tokens a step), a request queued behind it (one sequence at a
    time) and one cancelled in the queue: vLLM's decode, inference and per-token times, sizes,
    parameters, and finish reasons (abort for a cancel, none of its prompt counted)."""
    events: list = []
    config = EngineConfig(
        block_size=4, num_blocks=200, max_num_seqs=1, speculative=SpeculativeConfig("ngram", num_draft=4)
    )
    engine = LLMEngine(tiny, config, events.append)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 8, list(range(40, 60)), list(range(70, 75))]
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=greedy)) for p in prompts]
    engine.abort(ids[2])  # still waiting: it never runs
    while engine.has_work():
        engine.step()
    metrics = ServeMetrics("tiny", max_model_len=2048)
    start = min(e.t for e in events if isinstance(e, TokenGenerated)) - 0.01
    for rid in ids:
        metrics.arrived(rid, start, 1, 30)
    for event in events:
        metrics.observe(event)
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    ran = [done[ids[0]].stats, done[ids[1]].stats]
    assert done[ids[2]].finish_reason == "cancelled" and not done[ids[2]].stats.generated_tokens
    m = samples(metrics)
    decode = [sum(s.itl_s) for s in ran]
    assert m["kvscope:request_success_total{finished_reason=length}"] == 2
    assert m["kvscope:request_success_total{finished_reason=abort}"] == 1
    assert m["kvscope:prompt_tokens_total"] == len(prompts[0]) + len(prompts[1]), (
        "the cancelled one ran no prefill"
    )
    assert m["kvscope:request_prompt_tokens_sum"] == sum(len(p) for p in prompts)
    assert (
        m["kvscope:request_generation_tokens_sum"] == 60 and m["kvscope:request_generation_tokens_count"] == 3
    )
    assert m["kvscope:request_params_max_tokens_sum"] == 90 and m["kvscope:request_params_n_sum"] == 3
    # the phases: only the two that ran have them
    assert m["kvscope:request_decode_time_seconds_count"] == 2
    assert m["kvscope:request_decode_time_seconds_sum"] == pytest.approx(sum(decode))
    assert m["kvscope:request_inference_time_seconds_sum"] == pytest.approx(
        sum(s.prefill_s for s in ran) + sum(decode)
    )
    assert m["kvscope:request_queue_time_seconds_sum"] == pytest.approx(sum(s.queued_s for s in ran))
    # time per output token divides by the tokens, not the steps: a speculative round's tokens
    # each count, so it is below the mean inter-token gap when rounds gave several tokens
    assert m["kvscope:request_time_per_output_token_seconds_sum"] == pytest.approx(
        sum(d / 29 for d in decode)
    )
    first = ran[0]
    assert len(first.itl_s) < 29 and decode[0] / 29 < decode[0] / len(first.itl_s)


def test_a_request_that_fails_in_the_engine_counts_as_error(tiny):
    events: list = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=200), events.append)
    rid = engine.add_request(Request(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=8)))
    victim = engine.seqs[rid]

    def breaks(*args, **kwargs):
        raise FloatingPointError("simulated sampler failure")

    victim.sampler.sample = breaks
    while engine.has_work():
        engine.step()
    assert any(isinstance(e, RequestFailed) for e in events)
    metrics = ServeMetrics("tiny")
    metrics.arrived(rid, victim.arrival_time)
    metrics.arrived(999, victim.arrival_time)  # refused at admission: never started
    for event in [*events, RequestFailed(999, "refused", victim.arrival_time)]:
        metrics.observe(event)
    m = samples(metrics)
    assert m["kvscope:request_success_total{finished_reason=error}"] == 1
    assert m["kvscope:e2e_request_latency_seconds_count"] == 1 and m["kvscope:prompt_tokens_total"] == 0


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
