"""The packaged SmolLM2-135M-Instruct through the engine: greedy fp32 output equals transformers'
generate(do_sample=False) token for token, and the CLI's JSON contract."""

import json
import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import Request

pytestmark = pytest.mark.slow
NEW = 64

PROMPTS = {
    "english": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "chinese": "请用中文介绍一下长城的历史。",
    # far longer than several 16-token blocks
    "long": "Summarise the following notes.\n"
    + "\n".join(
        f"Note {i}: the meeting about project {i} moved to room {100 + i} at {i % 12 + 1} pm."
        for i in range(25)
    ),
}


@pytest.fixture(scope="module")
def references(default_loaded):
    tok = default_loaded.tokenizer
    refs = {}
    for name, text in PROMPTS.items():
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = default_loaded.model.generate(
                torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        refs[name] = (ids, out[0, len(ids) :].tolist())
    return refs


def test_greedy_matches_generate_on_the_packaged_model(default_loaded, references):
    events = []
    engine = LLMEngine(default_loaded, EngineConfig(block_size=16), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    ids = {
        name: engine.add_request(Request.chat(PROMPTS[name], sampling=params)) for name in PROMPTS
    }  # all three batched together
    while engine.has_work():
        engine.step()
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    for name, (prompt_ids, ref) in references.items():
        assert done[ids[name]].stats.prompt_tokens == len(prompt_ids)
        assert list(done[ids[name]].token_ids) == ref, name
    assert len(references["long"][0]) > 8 * 16
    assert engine.kv.pool.num_used == 0


def test_chinese_reply_streams_whole_characters(default_loaded):
    events = []
    engine = LLMEngine(default_loaded, EngineConfig(), events.append)
    engine.add_request(Request.chat(PROMPTS["chinese"], temperature=0.0, max_new_tokens=40))
    while engine.has_work():
        engine.step()
    deltas = [e.text_delta for e in events if hasattr(e, "text_delta")]
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    assert "".join(deltas) == done.text
    # only a reply cut by max_new_tokens mid-character may end in U+FFFD (the flushed tail)
    assert not any("\ufffd" in d for d in deltas[:-1])
    assert any("\u4e00" <= ch <= "\u9fff" for ch in done.text)


def run_cli(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_generate_json_contract(references):
    """The CLI in float32 (`--quantization none`) against the float32 reference: like against
    like. (The default, native bits, is compared with native alone in the next test: whether
    native tokens equal float32 ones depends on the weights' rounding, not on the CLI.)"""
    proc = run_cli(
        "generate",
        "--prompt",
        PROMPTS["english"],
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--temperature",
        "0",
        "--probs",
        "3",
        "--quantization",
        "none",
        "--json",
    )
    out = json.loads(proc.stdout)
    assert out["token_ids"] == references["english"][1][:12]
    assert out["prompt_tokens"] == len(references["english"][0])
    assert out["finish_reason"] == "length" and len(out["itl_s"]) == 11 and out["ttft_s"] > 0
    assert out["kv"]["block_size"] == 16 and out["kv"]["blocks_used_end"] == 0
    assert out["kv"]["peak_blocks_used"] == -(-(out["prompt_tokens"] + 11) // 16)
    assert len(out["probs"]) == 12
    first = out["probs"][0]
    assert first["id"] == out["token_ids"][0] and first["top_ids"][0] == first["id"]  # greedy = argmax
    assert len(first["top_probs"]) == 3 and abs(first["prob"] - first["top_probs"][0]) < 1e-6


def test_the_cli_at_native_bits_equals_the_engine_at_native_bits():
    """The default (native Q4_1/Q8_0) CLI against the same weights run in this process: the same
    machine's kernel table on both sides, so the comparison holds whatever kernels it chose."""
    from engine.config import ModelSpec
    from engine.model.loading import load_model

    native = load_model(ModelSpec("default"))
    events = []
    engine = LLMEngine(native, EngineConfig(), events.append)
    engine.add_request(Request.chat(PROMPTS["english"], temperature=0.0, max_new_tokens=12, ignore_eos=True))
    while engine.has_work():
        engine.step()
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    proc = run_cli(
        "generate", "--prompt", PROMPTS["english"], "--max-new-tokens", "12", "--ignore-eos",
        "--temperature", "0", "--json",
    )  # fmt: skip
    assert json.loads(proc.stdout)["token_ids"] == list(done.token_ids)


def test_cli_errors_are_one_clear_line(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--json", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "missing" in proc.stderr
    proc = run_cli("generate", "--prompt", "hi", "--top-p", "0", check=False)
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("generate", "--prompt", "word " * 9000, "--json", check=False)
    assert proc.returncode == 1 and "context" in proc.stderr and "Traceback" not in proc.stderr
