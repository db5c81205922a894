"""llama.cpp's llama-bench as a same-run peer: its batched step of as many rows as a verify step,
at the same context, read from its JSON (a stand-in binary here: no llama.cpp in the tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.bench.bench_speculative import _llama_verify
from engine.bench.llama_bench import BUILD_HINT, llama_batch_step

# prints llama-bench's JSON rows for its -p list at its -d depth, and records its arguments
FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "w").write(json.dumps(args))
prompts = [int(p) for p in args[args.index("-p") + 1].split(",")]
depth = int(args[args.index("-d") + 1])
print(json.dumps([
    {{"n_prompt": p, "n_gen": 0, "n_depth": depth, "avg_ns": 5e6 + 3e6 * (p - 1), "avg_ts": 1.0}}
    for p in prompts
]))
"""


def fake_llama_bench(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "args.json"
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE.format(python=sys.executable, log=str(log)))
    binary.chmod(0o755)
    return binary, log


def test_the_batched_step_is_read_at_the_verify_steps_rows_and_context(tmp_path):
    binary, log = fake_llama_bench(tmp_path)
    step = llama_batch_step(binary, tmp_path / "model.gguf", rows=5, depth=128, threads=2)
    assert step == {"one_row_ms": 5.0, "rows_ms": 17.0, "rows_vs_one_row": 17.0 / 5.0}
    args = json.loads(log.read_text())
    assert args[args.index("-p") + 1] == "1,5" and args[args.index("-d") + 1] == "128"
    assert args[args.index("-n") + 1] == "0" and args[args.index("-t") + 1] == "2"


def test_without_llama_bench_or_a_gguf_the_peer_says_why(tmp_path):
    step = {"drafts": 4, "context_tokens": 128}
    assert _llama_verify(None, "default", step) == {"skipped": BUILD_HINT}
    binary, _ = fake_llama_bench(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert _llama_verify(binary, str(folder), step) == {"skipped": "the model is not a GGUF file"}
