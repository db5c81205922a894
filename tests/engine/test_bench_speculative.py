"""`engine bench --speculation` on the tiny model: the verify step really verifies k drafts a
step against plain one-row steps, and the task runs report every method against plain decoding
with the greedy texts compared (no timing is asserted)."""

from __future__ import annotations

import argparse

from engine.bench.bench_speculative import _table, proposers, run_tasks
from engine.bench.verify_step import verify_step_cost


def test_the_verify_step_verifies_k_drafts_every_step(tiny_loaded):
    step = verify_step_cost(tiny_loaded, k=3, context=24, steps=4)
    assert step["drafts"] == 3 and step["verify_rows"] == [4]  # the last token and 3 drafts
    for side in ("plain", "verify"):
        assert step[side]["step_ms"] > 0 and step[side]["forward_ms"] > 0
        assert set(step["split_ms"][side]) == {
            "linears_ms",
            "lm_head_ms",
            "attention_ms",
            "step_ms",
            "rest_ms",
        }
    assert step["verify_vs_plain"]["step"] > 0
    assert "skipped" in step["roof"]  # a float32 model: no panel linears to put a roof on
    text = _table({"model": "tiny", "quantization": "none", "threads": 1, "verify_step": [step]})
    assert "roof: no linears multiplied as panels" in text


def test_every_method_is_run_against_plain_and_its_text_compared(tiny_loaded):
    args = argparse.Namespace(
        num_draft=3, adaptive_draft=False, draft_model=None, block_size=16, rounds=2, new_tokens=6
    )
    configs = proposers(args)
    assert set(configs) == {"ngram", "self"}
    report = run_tasks(tiny_loaded, args, configs)
    assert set(report) == {"repeat", "chat"}
    for rows in report.values():
        assert set(rows) == {"none", "ngram", "self"}
        for name, row in rows.items():
            assert len(row["rounds_s"]) == 2 and row["tokens_per_s"] > 0
            assert row["output_equals_plain"], f"{name}: speculative greedy text differs from plain"
        assert rows["self"]["drafts_proposed"] > 0
    text = _table({"model": "tiny", "quantization": "none", "threads": 1, "tasks": report})
    assert "same text: yes" in text and "NO" not in text
