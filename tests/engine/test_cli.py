"""The CLI: inspect-model on a config-only folder, chat and streamed generate on a tiny saved model."""

import json
import subprocess
import sys


def test_inspect_model_reads_only_config_json(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "inspect-model",
            str(tmp_path),
            "--dtype",
            "float16",
            "--context",
            "131072",
            "--budget-gib",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    assert out["kv_bytes_for_context"] == 16 * 2**30
    assert out["num_kv_heads"] == 8 and out["head_dim"] == 128 and out["num_layers"] == 32


def test_inspect_model_missing_path_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "inspect-model", str(tmp_path / "nothing-here"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nothing-here" in proc.stderr


def test_chat_keeps_the_conversation_across_turns(tmp_path, default_tokenizer):
    from model_folders import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "chat",
            "--model",
            str(folder),
            "--system",
            "Be brief.",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
        ],
        input="Hello\nAnd again\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("tok/s") == 2  # two replies, each with its figures
    assert "Traceback" not in proc.stderr


def test_generate_streams_text_without_json(tmp_path, default_tokenizer):
    from model_folders import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    args = ["generate", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos"]
    streamed = subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300
    )
    as_json = subprocess.run(
        [sys.executable, "-m", "engine", *args, "--json"], capture_output=True, text=True, timeout=300
    )
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"].rstrip("\n")
    assert "6 tokens, length" in streamed.stderr


def test_generate_with_speculation_reports_its_figures(tmp_path, default_tokenizer):
    from model_folders import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    base = ["generate", "--model", str(folder), "--prompt", "a b a b a b a b", "--max-new-tokens", "12",
            "--ignore-eos", "--json"]  # fmt: skip
    plain = subprocess.run(
        [sys.executable, "-m", "engine", *base], capture_output=True, text=True, timeout=300
    )
    spec = subprocess.run(
        [sys.executable, "-m", "engine", *base, "--speculative", "ngram", "--num-draft", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain_out, spec_out = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec_out["token_ids"] == plain_out["token_ids"]
    figures = spec_out["speculative"]
    assert set(figures) >= {"acceptance_rate", "mean_accepted_length", "target_forwards"}
    assert 0.0 <= figures["acceptance_rate"] <= 1.0
    assert figures["target_forwards"] == 1 + figures["rounds"] + figures["token_kinds"].count("") - 1
    assert "speculative" not in plain_out


def test_attention_kernels_prints_its_table(tmp_path, default_tokenizer):
    """The text report (not only --json): its byte figures go through engine.units.si."""
    from model_folders import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    args = [
        "sweep",
        "--attention-kernels",
        "--model",
        str(folder),
        "--prompt-lengths",
        "8,16",
        "--repeats",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    rows = [
        row for row in lines if row[:2] in (["8", "math"], ["8", "flash"], ["16", "math"], ["16", "flash"])
    ]
    assert len(rows) == 4, proc.stdout
