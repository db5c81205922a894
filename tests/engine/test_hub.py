"""The Hub through huggingface_hub, against a local server that answers its endpoints with real
files (tests/hub_server.py): search, file listing with the fit estimate, downloads interrupted
and resumed (within a call, and across calls after a failure or a cancel), gated and private
repos, offline, no network, a full disk, and the downloaded model answering like the original."""

from __future__ import annotations

import errno
import json
import shutil
import stat
import threading

import pytest
from hub_server import TOKEN, Fault, HubServer, Repo, repo_from_folder, use_hub
from model_folders import save_tiny_model

from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.errors import ModelLoadError
from engine.events import RequestFinished
from engine.hub.cache import delete_cached, list_cached
from engine.hub.download import DownloadCancelled, download_files
from engine.hub.files import quant_of, repo_files
from engine.hub.online import OFFLINE_IS_DEFAULT, OFFLINE_MESSAGE, HubError
from engine.hub.search import search_models
from engine.model.gguf_plan import kvk_here, plan_file
from engine.model.loading import load_model
from engine.model.sources import default_gguf_path
from engine.request import Request

TINY = "kvscope-test/tiny-llama-chat"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", default_tokenizer, seed=7)


@pytest.fixture(scope="module")
def gguf_bytes():
    return default_gguf_path().read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_folder, gguf_bytes):
    server = HubServer()
    server.add(repo_from_folder(TINY, tiny_folder, downloads=1234, likes=56))
    server.add(
        Repo(
            "kvscope-test/SmolLM2-135M-Instruct-GGUF",
            {
                "README.md": b"# SmolLM2 GGUF\n",
                "SmolLM2-135M-Instruct.Q4_1.gguf": gguf_bytes,
                "SmolLM2-135M-Instruct.Q8_0.gguf": gguf_bytes,  # the same bytes: the quant is the name's
                "SmolLM2-135M-Instruct-F16-00001-of-00002.gguf": gguf_bytes[:1000],
                "SmolLM2-135M-Instruct-F16-00002-of-00002.gguf": gguf_bytes[1000:2000],
            },
            downloads=99,
            likes=7,
            license="apache-2.0",
        )
    )
    server.add(repo_from_folder("kvscope-test/gated-llama", tiny_folder, gated="manual", license="llama3.2"))
    server.add(repo_from_folder("kvscope-test/private-llama", tiny_folder, private=True))
    server.add(Repo("kvscope-test/no-weights", {"README.md": b"# docs only\n", "config.json": b"{}"}))
    server.add(
        Repo("kvscope-test/bert", {"config.json": b'{"model_type": "bert"}'}, pipeline_tag="fill-mask")
    )
    server.start()
    use_hub(monkeypatch, server, tmp_path / "hub")
    yield server
    server.stop()


# ---- search -----------------------------------------------------------------------------
def test_search_lists_text_generation_models_with_their_figures(hub):
    hits = search_models("kvscope-test")
    ids = [h.repo_id for h in hits]
    assert "kvscope-test/bert" not in ids  # not a text-generation model
    assert "kvscope-test/private-llama" not in ids
    assert ids[0] == TINY, "most downloaded first"
    tiny = hits[0]
    assert (tiny.downloads, tiny.likes, tiny.license, tiny.gated) == (1234, 56, "apache-2.0", None)
    assert tiny.params and tiny.weights_bytes == tiny.params * 4  # F32, counted from the file's header
    assert tiny.formats == ("safetensors",) and tiny.supported and tiny.model_type == "llama"
    gated = next(h for h in hits if h.repo_id.endswith("gated-llama"))
    assert gated.gated == "manual" and gated.license == "llama3.2"
    gguf = next(h for h in hits if h.repo_id.endswith("GGUF"))
    assert gguf.formats == ("gguf",) and gguf.supported is None  # decided when its files are read
    assert [h.repo_id for h in search_models("gguf")] == ["kvscope-test/SmolLM2-135M-Instruct-GGUF"]


# ---- files and fit ----------------------------------------------------------------------
def test_files_group_weights_and_estimate_the_fit_before_any_weight_downloads(hub, tiny_folder):
    from engine.model.inspect import inspect_model

    files = repo_files(TINY, dtype="float32", context=1024, budget_gib=1.0)
    (choice,) = files.choices
    assert choice.kind == "safetensors" and WEIGHTS in choice.files and "tokenizer.json" in choice.files
    assert choice.weights_bytes == (tiny_folder / WEIGHTS).stat().st_size
    local = inspect_model(str(tiny_folder), dtype="float32", context=1024, budget_gib=1.0)
    for key in (
        "weight_bytes",
        "kv_bytes_per_token",
        "kv_bytes_for_context",
        "budget_bytes",
        "weights_fit_in_budget",
    ):
        assert choice.estimate[key] == local[key], key
    assert choice.estimate["fits_with_context"] and files.supported and files.support == "Llama"
    assert hub.ranges_for(WEIGHTS) == [], "the weights were not fetched to estimate"


def test_gguf_files_are_listed_by_quantization_with_shapes_from_the_remote_header(hub):
    from engine.model.inspect import inspect_model

    files = repo_files(
        "kvscope-test/SmolLM2-135M-Instruct-GGUF", dtype="float32", context=2048, budget_gib=4.0
    )
    labels = {c.label: c for c in files.choices}
    assert set(labels) == {"Q4_1", "Q8_0", "F16"}
    assert not labels["F16"].loadable and "split into 2 parts" in labels["F16"].note
    local = inspect_model(str(default_gguf_path()), dtype="float32", context=2048, budget_gib=4.0)
    q4 = labels["Q4_1"]
    assert q4.loadable and q4.weights_bytes == default_gguf_path().stat().st_size
    for key in ("num_layers", "num_kv_heads", "head_dim", "kv_bytes_per_token", "weight_bytes"):
        assert q4.estimate[key] == local[key], key
    # loaded on this CPU it stays at its own bits: what the loader's plan holds for each tensor,
    # read from the header's types and shapes (the same plan as the local file's), not 135 M x 4;
    # with the kvk kernels the file's blocks, memory-mapped: its tensors' bytes
    assert q4.estimate["weights_as"] == "native"
    assert q4.estimate["weight_plan"] == plan_file(default_gguf_path(), "float32").as_dict()
    if kvk_here() is not None:
        assert q4.estimate["weight_bytes"] == q4.estimate["weight_plan"]["file_bytes"]
    # only the header was read, in ranges: a few MB of a ~100 MB file
    ranges = hub.ranges_for("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert ranges and all(r.startswith("bytes=") for r in ranges)
    spans = [r.removeprefix("bytes=").split("-") for r in ranges]
    read = sum(int(stop) - int(start) + 1 for start, stop in spans)
    assert read < default_gguf_path().stat().st_size / 10, f"{read} bytes read for the header"
    assert files.supported and files.support == "Llama"


@pytest.mark.parametrize(
    "name, quant",
    [
        ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("llama-3.2-1b-instruct-q8_0.gguf", "Q8_0"),
        ("gemma-2-2b-it-IQ2_XS.gguf", "IQ2_XS"),
        ("model-bf16.gguf", "BF16"),
        ("phi-3-mini-4k-instruct-fp16.gguf", "FP16"),
        ("Mistral-7B-Q5_K_S-00001-of-00003.gguf", "Q5_K_S"),
        ("weights.gguf", "GGUF"),
    ],
)
def test_quantization_is_read_from_gguf_file_names(name, quant):
    assert quant_of(name) == quant


def test_a_repo_without_weights_says_so(hub):
    with pytest.raises(HubError, match="has no weights kvscope can load"):
        repo_files("kvscope-test/no-weights")


# ---- download ---------------------------------------------------------------------------
def _tokens(loaded, prompt="Hello there", n=6):
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64), events.append)
    engine.add_request(Request.chat(prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=n)))
    while engine.has_work():
        engine.step()
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    return list(done.token_ids)


def test_download_with_byte_progress_then_the_model_answers_like_the_original(hub, tiny_folder):
    choice = repo_files(TINY).choices[0]
    seen = []
    result = download_files(TINY, choice.files, progress=seen.append)
    assert result.source == TINY and result.total_bytes == choice.download_bytes
    # the estimate fetched config.json already; everything else arrives now
    assert result.cached_bytes == len(hub.repos[TINY].files["config.json"])
    assert result.downloaded_bytes + result.cached_bytes == result.total_bytes
    done = [p.done_bytes for p in seen]
    assert done == sorted(done) and done[-1] == result.total_bytes, "bytes only ever go up, to the total"
    assert len({p.done_bytes for p in seen if p.file == WEIGHTS}) > 3, "the big file reports as it arrives"
    assert (result.folder / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()
    # the user's alone: the repo's folder 0700, the downloaded blobs 0600
    repo_dir = result.folder.parent.parent
    assert stat.S_IMODE(repo_dir.stat().st_mode) == 0o700
    blob = (result.folder / WEIGHTS).resolve()
    assert blob.parent.name == "blobs" and stat.S_IMODE(blob.stat().st_mode) == 0o600
    # it is in the standard cache, and loads by repo id (kvscope's loader never downloads)
    (cached,) = list_cached()
    assert cached.repo_id == TINY and cached.size_bytes >= result.total_bytes and cached.partial_bytes == 0
    downloaded = load_model(ModelSpec(TINY, dtype="float32", device="cpu"))
    original = load_model(ModelSpec(str(tiny_folder), dtype="float32", device="cpu"))
    assert _tokens(downloaded) == _tokens(original)
    again = download_files(TINY, choice.files)
    assert again.downloaded_bytes == 0, "a second download finds everything cached"


def test_a_dropped_connection_resumes_within_the_download(hub, tiny_folder):
    size = (tiny_folder / WEIGHTS).stat().st_size
    hub.faults[WEIGHTS] = Fault(drop_after=size // 3, times=1)
    result = download_files(TINY, [WEIGHTS, "config.json"])
    first, retry = hub.ranges_for(WEIGHTS)
    # the retry asks for the rest only: from the last whole chunk written before the cut
    assert first == "" and 0 < _range_start(retry) <= size // 3
    assert (result.folder / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()


def partial_path(hub, name, repo_id=TINY):
    """Where a stopped download of `name` keeps its bytes: blobs/<sha256 ETag>.incomplete."""
    from engine.model.sources import hf_cache_dir

    folder = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "blobs"
    return folder / f"{hub.repos[repo_id].etag(name)}.incomplete"


def _range_start(header: str) -> int:
    assert header.startswith("bytes=") and header.endswith("-"), header
    return int(header.removeprefix("bytes=").removesuffix("-"))


def test_a_failed_download_keeps_its_part_and_the_next_one_resumes(hub, tiny_folder):
    size = (tiny_folder / WEIGHTS).stat().st_size
    hub.faults[WEIGHTS] = Fault(drop_after=size // 2, times=99)  # the network stays down
    with pytest.raises(HubError) as err:
        download_files(TINY, [WEIGHTS, "config.json"])
    assert "Cannot reach the Hugging Face Hub" in str(err.value) and "resumes" in str(err.value)
    kept = partial_path(hub, WEIGHTS).stat().st_size
    assert 0 < kept <= size // 2
    hub.faults.clear()  # the network is back
    result = download_files(TINY, [WEIGHTS, "config.json"])
    assert _range_start(hub.ranges_for(WEIGHTS)[-1]) == kept
    assert result.resumed_bytes == kept
    assert result.downloaded_bytes + result.resumed_bytes + result.cached_bytes == result.total_bytes
    assert (result.folder / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()


def test_cancel_keeps_what_arrived_and_the_next_download_resumes(hub, tiny_folder):
    hub.delay_s = 0.002
    cancel = threading.Event()

    def progress(p):
        if p.file == WEIGHTS and p.done_bytes > 2 * 2**20:
            cancel.set()

    with pytest.raises(DownloadCancelled, match="resumes where it stopped"):
        download_files(TINY, [WEIGHTS], progress=progress, cancel=cancel)
    hub.delay_s = 0.0
    result = download_files(TINY, [WEIGHTS])
    assert result.resumed_bytes > 2 * 2**20, "the chunks written before the cancel were kept"
    assert (result.folder / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()


def test_a_full_disk_is_refused_before_and_said_during_a_download(hub, tiny_folder, monkeypatch):
    import huggingface_hub.file_download as fd

    usage = shutil.disk_usage("/")
    with monkeypatch.context() as m:
        m.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
        with pytest.raises(HubError, match="Not enough disk space"):
            download_files(TINY, [WEIGHTS])
    data = (tiny_folder / WEIGHTS).read_bytes()

    def fills_the_disk(url, temp_file, **kwargs):
        temp_file.write(data[:4096])  # the first bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(fd, "http_get", fills_the_disk)
        with pytest.raises(HubError, match="The disk is full.*partial file is kept"):
            download_files(TINY, [WEIGHTS])
    result = download_files(TINY, [WEIGHTS])  # space again: it resumes after the 4096 bytes
    assert result.resumed_bytes == 4096 and hub.ranges_for(WEIGHTS)[-1] == "bytes=4096-"
    assert (result.folder / WEIGHTS).read_bytes() == data


def test_a_resumed_file_that_does_not_match_its_hash_is_fetched_again(hub, tiny_folder):
    partial = partial_path(hub, WEIGHTS)
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"\0" * 4096)  # not the file's bytes (a corrupted partial download)
    result = download_files(TINY, [WEIGHTS])
    assert hub.ranges_for(WEIGHTS)[-2:] == ["bytes=4096-", ""], "resumed, found wrong, fetched whole"
    assert (result.folder / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()


# ---- access -----------------------------------------------------------------------------
def test_a_gated_repo_needs_a_token_from_the_environment_or_the_token_file(hub, monkeypatch):
    from huggingface_hub import constants

    files = repo_files("kvscope-test/gated-llama")  # listing works without access, as on the Hub
    assert files.gated == "manual"
    with pytest.raises(HubError) as err:
        download_files("kvscope-test/gated-llama", [WEIGHTS])
    assert "is gated" in str(err.value) and "HF_TOKEN" in str(err.value)
    with open(constants.HF_TOKEN_PATH, "w") as f:  # what `hf auth login` leaves
        f.write(TOKEN)
    assert download_files("kvscope-test/gated-llama", [WEIGHTS]).downloaded_bytes > 0
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match="your Hugging Face token has no access"):
        download_files("kvscope-test/gated-llama", ["config.json"])


def test_a_private_repo_is_not_found_without_a_token(hub, monkeypatch):
    with pytest.raises(HubError, match="was not found on the Hub. If it is private, set HF_TOKEN"):
        repo_files("kvscope-test/private-llama")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert repo_files("kvscope-test/private-llama").supported


def test_offline_is_said_in_one_line_and_nothing_is_requested(hub, monkeypatch):
    monkeypatch.delenv(OFFLINE_IS_DEFAULT)  # HF_HUB_OFFLINE=1 is now the user's own setting
    before = len(hub.requests)
    for call in (
        lambda: search_models("tiny"),
        lambda: repo_files(TINY),
        lambda: download_files(TINY, [WEIGHTS]),
    ):
        with pytest.raises(HubError) as err:
            call()
        assert str(err.value) == OFFLINE_MESSAGE
    assert len(hub.requests) == before


def test_no_network_is_said_in_one_line(hub, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    from huggingface_hub.utils import _http

    backoffs: list[float] = []
    monkeypatch.setattr(_http.time, "sleep", backoffs.append)
    with pytest.raises(HubError) as err:
        search_models("tiny")
    # said at once: no retries with backoff (huggingface_hub's would wait 23 s to say the same)
    assert backoffs == []
    assert str(err.value).startswith(
        "Cannot reach the Hugging Face Hub at http://127.0.0.1"
    ) and "\n" not in str(err.value)


# ---- bad files --------------------------------------------------------------------------
def test_a_safetensors_file_with_a_broken_header_fails_to_load_with_a_message(hub, tiny_folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    data = (broken / WEIGHTS).read_bytes()
    (broken / WEIGHTS).write_bytes(data[:8] + b"{not json" + data[17:])
    hub.add(repo_from_folder("kvscope-test/broken-header", broken))
    download_files("kvscope-test/broken-header", repo_files("kvscope-test/broken-header").choices[0].files)
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelSpec("kvscope-test/broken-header", dtype="float32", device="cpu"))
    assert "could not be read" in str(err.value) and "re-download" in str(err.value)


def test_a_config_that_needs_the_repos_own_code_is_refused(hub, tiny_folder, tmp_path):
    custom = tmp_path / "custom"
    shutil.copytree(tiny_folder, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="my_llama", auto_map={"AutoModelForCausalLM": "modeling_my.MyLlama"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "modeling_my.py").write_text("raise SystemExit('kvscope must never run this')\n")
    hub.add(repo_from_folder("kvscope-test/custom-code", custom))
    download_files("kvscope-test/custom-code", repo_files("kvscope-test/custom-code").choices[0].files)
    with pytest.raises(
        ModelLoadError, match="needs custom Python code from the model repo, which kvscope never runs"
    ):
        load_model(ModelSpec("kvscope-test/custom-code", dtype="float32", device="cpu"))


# ---- the cache --------------------------------------------------------------------------
def test_the_cache_lists_sizes_and_delete_frees_them(hub):
    download_files(TINY, ["config.json", WEIGHTS])
    download_files("kvscope-test/SmolLM2-135M-Instruct-GGUF", ["SmolLM2-135M-Instruct.Q4_1.gguf"])
    cached = {c.repo_id: c for c in list_cached()}
    gguf = cached["kvscope-test/SmolLM2-135M-Instruct-GGUF"]
    assert gguf.weights == ("gguf",) and gguf.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert cached[TINY].source == TINY
    freed = delete_cached(TINY)
    assert freed >= cached[TINY].size_bytes
    assert [c.repo_id for c in list_cached()] == ["kvscope-test/SmolLM2-135M-Instruct-GGUF"]
    with pytest.raises(HubError, match="is not in the Hugging Face cache"):
        delete_cached(TINY)


def test_a_download_stays_at_the_planned_commit_while_main_moves(hub, tiny_folder):
    """`main` moves after the files were planned (the first bytes arrived): every file still
    comes from the planned commit, the snapshot is that commit's, refs/main names it, and no
    request asked for `main`."""
    repo = hub.repos[TINY]
    planned = repo.sha
    old = dict(repo.files)
    files = repo_files(TINY).choices[0].files
    moved = []

    def move_main(progress):
        if not moved and progress.done_bytes:
            new = {name: data + b" " if name.endswith(".json") else data[::-1] for name, data in old.items()}
            moved.append(repo.commit(new))

    result = download_files(TINY, files, progress=move_main)
    assert moved and moved[0] != planned
    assert result.revision == planned and result.folder.name == planned
    assert all((result.folder / name).read_bytes() == old[name] for name in files)
    refs = result.folder.parent.parent / "refs" / "main"
    assert refs.read_text() == planned
    fetched = [path for _, path, _ in hub.requests if "/resolve/" in path and WEIGHTS in path]
    assert fetched and all(f"/resolve/{planned}/" in path for path in fetched), fetched
    downloaded = load_model(ModelSpec(TINY, dtype="float32", device="cpu"))
    original = load_model(ModelSpec(str(tiny_folder), dtype="float32", device="cpu"))
    assert _tokens(downloaded) == _tokens(original)
