"""`--model REPO` for a GGUF repo in the local HF cache: its one .gguf file, or the files named
when there are several (then `REPO:FILE` or `--gguf-file`), and a one-line message otherwise; the
same source string in the CLI, the server and the app."""

from __future__ import annotations

import pytest
from gguf_files import write_tiny_llama
from model_folders import LLAMA_8B_CONFIG, fake_hf_cache

from engine.cli.main import build_parser, main
from engine.errors import ModelLoadError
from engine.model.inspect import inspect_model
from engine.model.sources import default_gguf_path, repo_file_of, resolve_source, with_gguf_file

ONE = "someone/SmolLM2-135M-Instruct-GGUF"
SEVERAL = "someone/tiny-llama-GGUF"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


@pytest.fixture
def repos(hf_cache, tmp_path):
    fake_hf_cache(hf_cache, ONE, {"SmolLM2-135M-Instruct.Q4_1.gguf": default_gguf_path(), "README.md": {}})
    a = write_tiny_llama(tmp_path / "a.gguf")
    b = write_tiny_llama(tmp_path / "b.gguf", seed=1)
    fake_hf_cache(hf_cache, SEVERAL, {"tiny-Q4_1.gguf": a, "sub/tiny-Q8_0.gguf": b, "mmproj-f16.gguf": a})
    return hf_cache


def test_a_repo_with_one_gguf_resolves_to_that_file(repos):
    src = resolve_source(ONE)
    assert src.kind == "gguf" and src.gguf == src.path and src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert src.name == "SmolLM2-135M-Instruct.Q4_1"
    assert repo_file_of(src.path, repos) == (ONE, "SmolLM2-135M-Instruct.Q4_1.gguf")
    report = inspect_model(ONE)  # metadata only, from the cached file
    assert report["num_layers"] == 30 and report["weights_as"] == "native"


def test_several_ggufs_are_named_and_one_is_chosen_by_name(repos):
    with pytest.raises(ModelLoadError) as refused:
        resolve_source(SEVERAL)
    message = str(refused.value)
    assert "has 2 GGUF files in the local cache: sub/tiny-Q8_0.gguf, tiny-Q4_1.gguf" in message
    assert f"--model {SEVERAL}:sub/tiny-Q8_0.gguf (or --gguf-file sub/tiny-Q8_0.gguf)" in message
    assert "mmproj" not in message and "\n" not in message
    chosen = resolve_source(f"{SEVERAL}:tiny-Q4_1.gguf")
    assert chosen.kind == "gguf" and chosen.path.name == "tiny-Q4_1.gguf"
    assert resolve_source(with_gguf_file(SEVERAL, "sub/tiny-Q8_0.gguf")).path.name == "tiny-Q8_0.gguf"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            f"{SEVERAL}:absent.gguf",
            "has no file absent.gguf in the local Hugging Face cache (its GGUF files here",
        ),
        ("nobody/not-downloaded", "is not in the local Hugging Face cache"),
        ("nobody/not-downloaded:x.gguf", "is not in the local Hugging Face cache"),
        ("someone/empty", "holds neither a config.json (a transformers model) nor a .gguf file"),
        ("someone/split:big-00001-of-00002.gguf", "is one part of a split GGUF"),
    ],
)
def test_what_cannot_be_resolved_says_why_in_one_line(repos, tmp_path, source, expected):
    fake_hf_cache(repos, "someone/empty", {"README.md": {}})
    part = write_tiny_llama(tmp_path / "part.gguf")
    fake_hf_cache(repos, "someone/split", {"big-00001-of-00002.gguf": part})
    with pytest.raises(ModelLoadError, match=expected.replace("(", r"\(").replace(")", r"\)")) as refused:
        resolve_source(source)
    assert "\n" not in str(refused.value)


def test_a_transformers_repo_still_resolves_to_its_folder(repos):
    fake_hf_cache(repos, "someone/llama-8b", {"config.json": LLAMA_8B_CONFIG, "x.gguf": {}})
    src = resolve_source("someone/llama-8b")
    assert src.kind == "repo" and src.name == "someone/llama-8b" and src.gguf is None


def test_gguf_file_needs_a_repo_id():
    with pytest.raises(ModelLoadError, match="is not a repo id"):
        with_gguf_file("/some/path.gguf", "x.gguf")
    assert with_gguf_file("a/b", None) == "a/b"


def test_the_cli_and_the_server_take_gguf_file(repos, capsys):
    for command in (["generate", "--prompt", "hi"], ["serve"], ["chat"]):
        args = build_parser().parse_args([*command, "--model", SEVERAL, "--gguf-file", "tiny-Q4_1.gguf"])
        assert args.gguf_file == "tiny-Q4_1.gguf"
    assert main(["inspect-model", SEVERAL, "--gguf-file", "tiny-Q4_1.gguf", "--json"]) == 0
    assert '"num_layers": 2' in capsys.readouterr().out
    assert main(["inspect-model", SEVERAL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has 2 GGUF files" in err and err.count("\n") == 1


@pytest.mark.slow
def test_generate_loads_a_cached_gguf_repo_by_its_id(repos, capsys):
    assert main(["generate", "--model", ONE, "--prompt", "Hi", "--max-new-tokens", "3", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 3 and out["model"]["name"] == "SmolLM2-135M-Instruct.Q4_1"
