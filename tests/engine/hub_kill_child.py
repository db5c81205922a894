"""Downloads a repo's files from the test Hub server named on the command line, slowly, printing
each byte count: the parent kills it with SIGKILL mid-file (tests/engine/test_hub_kill.py)."""

from __future__ import annotations

import sys

from huggingface_hub import constants

from engine.hub.download import download_files

url, cache, repo, *files = sys.argv[1:]
constants.HF_HUB_CACHE = cache
constants.HF_HUB_OFFLINE = False


def progress(p) -> None:
    print(p.done_bytes, flush=True)


download_files(repo, files, progress=progress)
print("done", flush=True)
