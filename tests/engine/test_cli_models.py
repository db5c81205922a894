"""`python -m engine models ...` against the local Hub server, and the models already on this
machine (HF cache, LM Studio, GPT4All, Ollama). Each bad input prints one line and exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import TOKEN, Fault, HubServer, Repo, repo_from_folder, use_hub
from model_folders import save_tiny_model

from engine.cli.main import main
from engine.hub.cache import find_local_models
from engine.model.local_models import ollama_models
from engine.model.sources import default_gguf_path, resolve_source

TINY = "kvscope-test/tiny-llama-chat"
GGUF_REPO = "kvscope-test/SmolLM2-135M-Instruct-GGUF"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", default_tokenizer, seed=7)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_folder):
    server = HubServer()
    server.add(repo_from_folder(TINY, tiny_folder, downloads=10))
    server.add(repo_from_folder("kvscope-test/gated-llama", tiny_folder, gated="manual"))
    server.add(Repo(GGUF_REPO, {"SmolLM2-135M-Instruct.Q4_1.gguf": default_gguf_path().read_bytes()}))
    server.add(Repo("kvscope-test/no-weights", {"README.md": b"# docs only\n"}))
    mamba = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64}
    server.add(
        Repo("kvscope-test/mamba", {"config.json": json.dumps(mamba).encode(), "model.safetensors": b""})
    )
    server.start()
    use_hub(monkeypatch, server, tmp_path / "hub")
    yield server
    server.stop()


def cli(capsys, *argv):
    code = main(["models", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_search_and_files_print_json(hub, capsys):
    code, out, _ = cli(capsys, "search", "kvscope", "--json")
    hits = json.loads(out)
    assert code == 0 and hits[0]["repo_id"] == TINY and hits[0]["supported"] is True
    code, out, _ = cli(capsys, "files", TINY, "--dtype", "float32", "--context", "512", "--json")
    files = json.loads(out)
    (choice,) = files["choices"]
    assert code == 0 and choice["kind"] == "safetensors" and choice["estimate"]["context"] == 512
    code, out, _ = cli(capsys, "files", GGUF_REPO)
    assert code == 0 and "Q4_1" in out and "fits" in out


def test_download_list_and_delete(hub, capsys, tiny_folder):
    code, out, err = cli(capsys, "download", TINY, "--json")
    report = json.loads(out)
    assert code == 0 and report["source"] == TINY and report["downloaded_bytes"] > 0
    assert "100%" in err, "a byte-level bar on stderr"
    code, out, _ = cli(capsys, "download", GGUF_REPO, "--gguf", "q4_1")
    assert code == 0 and "load it with: kvscope --model " in out and out.strip().endswith(".gguf")
    code, out, _ = cli(capsys, "list", "--json")
    listed = {m["repo_id"]: m for m in json.loads(out)["hf_cache"]}
    assert set(listed) == {TINY, GGUF_REPO} and listed[TINY]["size_bytes"] >= report["total_bytes"]
    code, out, _ = cli(capsys, "delete", TINY)
    assert code == 0 and "freed" in out
    code, out, _ = cli(capsys, "list", "--json")
    assert [m["repo_id"] for m in json.loads(out)["hf_cache"]] == [GGUF_REPO]


@pytest.mark.parametrize(
    "argv, message",
    [
        (("files", "kvscope-test/no-weights"), "has no weights kvscope can load"),
        (("download", "kvscope-test/gated-llama"), "is gated: accept its licence"),
        (("download", "kvscope-test/nope"), "was not found on the Hub"),
        (("download", GGUF_REPO), "has GGUF files only: choose one with --gguf (Q4_1)"),
        (("download", GGUF_REPO, "--gguf", "Q8_0"), "has no single-file GGUF Q8_0; it has: Q4_1"),
        (("delete", TINY), "is not in the Hugging Face cache"),
        (("search", "x", "--limit", "0"), "the result limit must be between 1 and 1000"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(hub, capsys, argv, message):
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_architecture_kvscope_cannot_run_exactly_is_marked_before_download(hub, capsys):
    code, out, _ = cli(capsys, "files", "kvscope-test/mamba")
    assert code == 0 and "kvscope: refuses" in out and "recurrent (state-space)" in out


def test_the_network_failing_mid_download_is_one_line_then_resumes(hub, capsys, tiny_folder):
    size = (tiny_folder / "model.safetensors").stat().st_size
    hub.faults["model.safetensors"] = Fault(drop_after=size // 2, times=99)
    code, out, err = cli(capsys, "download", TINY)
    assert code == 2 and "Cannot reach the Hugging Face Hub" in err.splitlines()[-1]
    hub.faults.clear()
    code, out, _ = cli(capsys, "download", TINY, "--json")
    assert code == 0 and json.loads(out)["resumed_bytes"] > 0


def test_a_gated_download_with_the_token_works(hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, out, _ = cli(capsys, "download", "kvscope-test/gated-llama", "--json")
    assert code == 0 and json.loads(out)["downloaded_bytes"] > 0


def test_offline_in_a_fresh_process_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    env.pop("KVSCOPE_HF_OFFLINE_IS_DEFAULT", None)
    run = subprocess.run(
        [sys.executable, "-m", "engine", "models", "search", "llama"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: Offline: HF_HUB_OFFLINE is set") and run.stderr.count("\n") == 1


# ---- models already on this machine ---------------------------------------------------------
@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A home folder with LM Studio, GPT4All and Ollama stores, each holding the packaged GGUF."""
    home = tmp_path / "home"
    gguf = default_gguf_path()
    lms = home / ".lmstudio" / "models" / "bartowski" / "SmolLM2-GGUF"
    lms.mkdir(parents=True)
    (lms / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(gguf)
    (lms / "mmproj-SmolLM2-f16.gguf").symlink_to(gguf)  # a vision projector: not a model
    g4a = home / ".local" / "share" / "nomic.ai" / "GPT4All"
    g4a.mkdir(parents=True)
    (g4a / "smollm2-135m.Q4_1.gguf").symlink_to(gguf)
    ollama = home / ".ollama" / "models"
    digest = "sha256-" + "ab" * 32
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / digest).symlink_to(gguf)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest.replace("-", ":"), "size": 1},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.delenv("LMSTUDIO_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    return home


def test_models_on_this_machine_are_found_with_their_sizes(machine, hub):
    found = {(m.where, m.name): m for m in find_local_models()}
    size = default_gguf_path().stat().st_size
    assert set(found) == {
        ("LM Studio", "bartowski/SmolLM2-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"),
        ("GPT4All", "smollm2-135m.Q4_1.gguf"),
        ("Ollama", "smollm2:135m"),
    }
    assert all(m.size_bytes == size for m in found.values())
    (ollama,) = ollama_models()
    src = resolve_source(ollama.source)  # an Ollama blob has no .gguf suffix: its magic says GGUF
    assert src.is_gguf and src.kind == "gguf" and src.name == "smollm2:135m"


def test_list_shows_the_other_stores(machine, hub, capsys):
    code, out, _ = cli(capsys, "list")
    assert code == 0 and "Ollama" in out and "smollm2:135m" in out and "LM Studio" in out


# ---- the rest of the bad inputs, as the CLI says them ---------------------------------
def test_a_full_disk_is_one_line(hub, capsys, monkeypatch):
    import shutil

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, out, err = cli(capsys, "download", TINY)
    assert code == 2 and "Not enough disk space" in err and err.count("\n") == 1


def test_custom_code_and_a_broken_safetensors_header_are_one_line(hub, capsys, tiny_folder, tmp_path):
    custom = json.loads((tiny_folder / "config.json").read_text())
    custom.update(model_type="my_llama", auto_map={"AutoModelForCausalLM": "modeling_my.MyLlama"})
    hub.add(
        Repo(
            "kvscope-test/custom-code",
            {"config.json": json.dumps(custom).encode(), "model.safetensors": b"x"},
        )
    )
    code, out, _ = cli(capsys, "files", "kvscope-test/custom-code")
    assert code == 0 and "needs custom Python code from the model repo, which kvscope never runs" in out

    files = {p.name: p.read_bytes() for p in tiny_folder.iterdir() if p.is_file()}
    data = files["model.safetensors"]
    files["model.safetensors"] = data[:8] + b"{not json" + data[17:]
    hub.add(Repo("kvscope-test/broken-header", files))
    assert cli(capsys, "download", "kvscope-test/broken-header")[0] == 0
    code = main(["generate", "--model", "kvscope-test/broken-header", "--device", "cpu", "--prompt", "Hi"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: The weights of kvscope-test/broken-header could not be read")
