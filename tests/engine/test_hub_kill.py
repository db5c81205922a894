"""kill -9 during a Hub download, for real: a process downloading a model is killed mid-file;
what arrived stays as the blob's partial file, and the next start's download resumes from it
(a Range request from the kept bytes) to the exact file (issue 24)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import HubServer, repo_from_folder, use_hub
from model_folders import save_tiny_model

from engine.hub.cache import list_cached
from engine.hub.download import download_files

REPO = "kvscope-test/tiny-llama-chat"
WEIGHTS = "model.safetensors"
CHILD = Path(__file__).with_name("hub_kill_child.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(tmp_path, monkeypatch, default_tokenizer):
    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer, seed=7)
    server = HubServer(delay_s=0.01)  # 64 KiB per 10 ms: a file of MBs takes seconds
    server.add(repo_from_folder(REPO, folder))
    server.start()
    use_hub(monkeypatch, server, tmp_path / "hub")
    yield server, folder, tmp_path / "hub"
    server.stop()


def test_kill_9_mid_download_then_the_next_start_resumes(hub):
    server, folder, cache = hub
    size = (folder / WEIGHTS).stat().st_size
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), server.url, str(cache), REPO, WEIGHTS],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        for line in child.stdout:
            if line.strip().isdigit() and int(line) > size // 4:
                break  # a quarter of the weights arrived
            assert time.monotonic() < deadline, "the download did not start"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    (cached,) = list_cached()  # what the app's Hub browser shows: a resumable part
    kept = cached.partial_bytes
    assert 0 < kept < size  # what reached the disk before the kill (the last chunk may not have)
    server.delay_s = 0.0
    server.requests.clear()
    result = download_files(REPO, [WEIGHTS])  # the next start
    (resumed_from,) = [
        h.get("Range", "") for m, p, h in server.requests if m == "GET" and p.endswith(WEIGHTS)
    ]
    assert resumed_from == f"bytes={kept}-"
    assert result.resumed_bytes == kept and result.downloaded_bytes == size - kept
    assert (result.folder / WEIGHTS).read_bytes() == (folder / WEIGHTS).read_bytes()
    assert list_cached()[0].partial_bytes == 0
