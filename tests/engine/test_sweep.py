"""Sweeps and roofline points through the real engine on the tiny model, and the `roofline` and
`sweep` CLI commands on a tiny saved model (shapes of the results, never their speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.bench.sweep import (
    measure_roofline_points,
    prompt_ids,
    sweep_context_lengths,
    sweep_prompt_lengths,
)
from engine.config import ConfigError
from engine.measure import device_limits
from engine.measure.roofline import step_cost
from engine.shapes import ModelShapes


def test_prompt_ids_have_the_asked_length(default_tokenizer):
    assert [len(prompt_ids(default_tokenizer, n)) for n in (1, 7, 300)] == [1, 7, 300]


def test_prompt_sweep_one_row_per_length(tiny_loaded):
    rows = sweep_prompt_lengths(tiny_loaded, [8, 64], repeats=1)
    assert [r["prompt_tokens"] for r in rows] == [8, 64]
    for r in rows:
        assert r["dtype"] == "float32"
        assert r["ttft_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["achieved_flops_per_s"] > 0
        assert r["ttft_min_s"] <= r["ttft_s"]
    # Each row carries the counted cost of its one prefill step (fp32 weights and KV).
    shapes = ModelShapes.from_config(tiny_loaded.model.config)
    for r in rows:
        cost = step_cost(shapes, [(r["prompt_tokens"], r["prompt_tokens"])], 4, 4)
        assert (r["flops"], r["bytes"]) == (cost.flops, cost.bytes_total)
    assert rows[1]["intensity"] > rows[0]["intensity"]


def test_context_sweep_one_row_per_context(tiny_loaded):
    rows = sweep_context_lengths(tiny_loaded, [16, 200], decode_tokens=3, repeats=1)
    assert [r["context_tokens"] for r in rows] == [16, 200]
    for r in rows:
        assert r["median_itl_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["achieved_bytes_per_s"] > 0
    # Decode steps at contexts 17, 18, 19 (prompt + new tokens so far): their mean KV read.
    per_token = tiny_loaded.info.kv_bytes_per_token
    assert rows[0]["kv_read_bytes"] == pytest.approx(18 * per_token)
    assert rows[1]["kv_read_bytes"] == pytest.approx(202 * per_token)


def test_sweep_lengths_are_checked(tiny_loaded):
    with pytest.raises(ConfigError, match="at least 1"):
        sweep_prompt_lengths(tiny_loaded, [0])
    with pytest.raises(ConfigError, match="holds 2048"):
        sweep_context_lengths(tiny_loaded, [2048])


def test_roofline_points_prefill_and_decode_per_batch(tiny_loaded, monkeypatch):
    monkeypatch.setattr(device_limits, "MATMUL_SIZES", (64, 128))
    monkeypatch.setattr(device_limits, "BANDWIDTH_BYTES", 4 * 2**20)
    limits = device_limits.measure_device_limits("cpu", "float32")
    points = measure_roofline_points(
        tiny_loaded, limits, prompt_tokens=24, decode_steps=3, batch_sizes=[1, 3]
    )
    assert [(p["phase"], p["batch"], p["steps"]) for p in points] == [
        ("prefill", 1, 1),
        ("decode", 1, 3),
        ("prefill", 3, 1),
        ("decode", 3, 3),
    ]
    prefill_1, decode_1, _, decode_3 = points
    assert prefill_1["query_tokens_per_step"] == 24 and decode_3["query_tokens_per_step"] == 3
    # The prefill point's figures are the counted cost of its one step over its measured time.
    cost = step_cost(ModelShapes.from_config(tiny_loaded.model.config), [(24, 24)], 4, 4)
    assert prefill_1["flops_per_step"] == cost.flops and prefill_1["bytes_per_step"] == cost.bytes_total
    assert prefill_1["mfu"] == pytest.approx(cost.flops / prefill_1["forward_s_per_step"] / limits.peak_flops)
    assert (
        decode_3["intensity"] > 2 * decode_1["intensity"] and prefill_1["intensity"] > decode_1["intensity"]
    )
    for p in points:
        assert p["mfu"] > 0 and p["mbu"] > 0 and p["bound"] in ("compute-bound", "memory-bound")
        assert p["mfu_how"].startswith("MFU = ") and p["mbu_how"].startswith("MBU = ")
        assert p["best_of_rounds"] == 2


def _run_cli(args: list[str], cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    from model_folders import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("physics") / "tiny", default_tokenizer)


def test_cli_roofline_prints_limits_and_points(tiny_folder, tmp_path):
    args = [
        "roofline",
        "--model",
        str(tiny_folder),
        "--prompt-tokens",
        "32",
        "--decode-steps",
        "3",
        "--rounds",
        "1",
    ]
    proc = _run_cli([*args, "--batch-sizes", "1,2", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    lim = out["device_limits"]
    assert lim["peak_flops"] > 0 and lim["bandwidth"] > 0 and lim["dtype"] == "float32"
    assert lim["ridge_flops_per_byte"] == pytest.approx(lim["peak_flops"] / lim["bandwidth"])
    assert [(p["phase"], p["batch"]) for p in out["points"]] == [
        ("prefill", 1),
        ("decode", 1),
        ("prefill", 2),
        ("decode", 2),
    ]
    assert all(p["achieved_flops_per_s"] > 0 and p["achieved_bytes_per_s"] > 0 for p in out["points"])
    # The limits were cached: a second run reads the same measurement back.
    again = _run_cli([*args, "--batch-sizes", "1"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{lim['matmul_size']}^2" in again.stdout and "decode" in again.stdout


def test_cli_sweep_compares_dtypes(tiny_folder, tmp_path):
    proc = _run_cli(
        [
            "sweep",
            "--model",
            str(tiny_folder),
            "--dtypes",
            "float32,bfloat16",
            "--prompt-lengths",
            "8,32",
            "--context-lengths",
            "16,48",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--json",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["baseline_dtype"] == "float32"
    prompt = {(r["dtype"], r["prompt_tokens"]): r for r in out["prompt_lengths"]}
    context = {(r["dtype"], r["context_tokens"]): r for r in out["context_lengths"]}
    assert set(prompt) == {(d, n) for d in ("float32", "bfloat16") for n in (8, 32)}
    assert set(context) == {(d, n) for d in ("float32", "bfloat16") for n in (16, 48)}
    assert all(prompt[("float32", n)]["ttft_s_vs_float32"] == 1.0 for n in (8, 32))
    assert all(r["ttft_s"] > 0 and r["ttft_s_vs_float32"] > 0 for r in prompt.values())
    assert all(r["median_itl_s"] > 0 and r["median_itl_s_vs_float32"] > 0 for r in context.values())


def test_cli_bad_input_is_one_clear_line(tiny_folder, tmp_path):
    bad_list = _run_cli(["sweep", "--model", str(tiny_folder), "--prompt-lengths", "32,abc"], tmp_path)
    assert bad_list.returncode == 2 and "Traceback" not in bad_list.stderr and "32,abc" in bad_list.stderr
    too_long = _run_cli(
        ["sweep", "--model", str(tiny_folder), "--dtypes", "float32", "--prompt-lengths", "5000"], tmp_path
    )
    assert too_long.returncode == 2 and "Traceback" not in too_long.stderr
    assert "holds 2048" in too_long.stderr
