"""Beam search on the packaged SmolLM2-135M-Instruct, fp32: the engine's ranked beams and their
scores equal transformers' generate(num_beams=3, do_sample=False), and the beams shared blocks."""

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import Request

pytestmark = pytest.mark.slow
NEW = 24
K = 3


def test_beams_match_generate_on_the_packaged_model(default_loaded):
    # transformers' defaults; the tiny-model tests cover the other penalties and stopping modes
    length_penalty, early_stopping = 1.0, False
    events = []
    engine = LLMEngine(default_loaded, EngineConfig(block_size=16), events.append)
    params = SamplingParams(
        temperature=0.0,
        num_beams=K,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=NEW,
    )
    request = Request.chat("Name three fruits.", sampling=params)
    prompt = engine.prompt_ids(request)
    rid = engine.add_request(request)
    while engine.has_work():
        engine.step()
    (finished,) = [e for e in events if isinstance(e, RequestFinished) and e.request_id == rid]
    assert engine.kv.pool.num_used == 0

    eos = sorted(engine.eos_ids)
    with torch.inference_mode():
        out = default_loaded.model.generate(
            torch.tensor([prompt]),
            num_beams=K,
            num_return_sequences=K,
            do_sample=False,
            max_new_tokens=NEW,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=default_loaded.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
    ref_seqs = out.sequences[:, len(prompt) :].tolist()
    ours = [list(s.token_ids) for s in finished.sequences]
    for tokens, ref in zip(ours, ref_seqs, strict=True):
        assert tokens == ref[: len(tokens)]
        assert len(tokens) == len(ref) or ref[len(tokens) - 1] in eos  # shorter only when it ended
    assert [s.score for s in finished.sequences] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    assert finished.text == finished.sequences[0].text and finished.text
    group = finished.group
    assert group.shared_blocks < group.unshared_blocks_equivalent
