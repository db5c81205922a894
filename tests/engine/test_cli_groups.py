"""`generate --n` and `--num-beams` on a tiny saved model: every sequence with its score and the
group's block sharing in --json, the sequences one after another without it, bad combinations
refused in one line."""

import json
import subprocess
import sys

import pytest


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "engine", "generate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_tokenizer):
    from model_folders import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), default_tokenizer))


def test_beams_in_json(folder):
    proc = run_cli("--model", folder, "--prompt", "Name a colour.", "--max-new-tokens", "8",
                   "--num-beams", "3", "--length-penalty", "0.5", "--early-stopping", "never", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    seqs = out["sequences"]
    assert len(seqs) == 3
    assert [s["score"] for s in seqs] == sorted((s["score"] for s in seqs), reverse=True)
    assert all(set(s) >= {"text", "token_ids", "score", "finish_reason"} for s in seqs)
    assert out["token_ids"] == seqs[0]["token_ids"] and out["text"] == seqs[0]["text"]
    assert 0 < out["shared_blocks"] < out["unshared_blocks_equivalent"]
    assert out["cow_copies"] >= 0 and out["kv"]["blocks_used_end"] == 0


def test_samples_printed_one_after_another(folder):
    args = ["--model", folder, "--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos",
            "--n", "3", "--temperature", "0.9", "--seed", "4"]  # fmt: skip
    printed = run_cli(*args)
    as_json = run_cli(*args, "--json")
    assert printed.returncode == 0 and as_json.returncode == 0, printed.stderr + as_json.stderr
    seqs = json.loads(as_json.stdout)["sequences"]
    assert sorted(s["branch"] for s in seqs) == [0, 1, 2]
    assert all(len(s["token_ids"]) == 6 and s["finish_reason"] == "length" for s in seqs)
    for s in seqs:  # same seed, same samples, in the same (score) order
        assert (
            f"--- sample {s['branch']} (score {s['score']:.4f}, 6 tokens, length)\n{s['text']}\n"
            in printed.stdout
        )
    assert "3 samples:" in printed.stderr and "saved" in printed.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["--n", "2", "--num-beams", "2"], "not both"),
        (["--n", "2"], "temperature above 0"),  # generate defaults to greedy
        (["--num-beams", "2", "--temperature", "0.7"], "temperature 0"),
        (["--num-beams", "0"], "num_beams"),
    ],
)
def test_bad_combinations_are_one_clear_line(folder, args, words):
    proc = run_cli("--model", folder, "--prompt", "Hi", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert words in proc.stderr and proc.stderr.startswith("error:")


def test_bad_early_stopping_word(folder):
    proc = run_cli("--model", folder, "--prompt", "Hi", "--num-beams", "2", "--early-stopping", "soon")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "never" in proc.stderr
