"""llama.cpp's `llama-bench` as a peer in the same run: the same GGUF file, prompt length, new
tokens and threads. Found on PATH, at --llama-bench PATH, or where ../shared/tools/build-llama-bench
puts it; absent, the bench says so and how to build it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BUILD_HINT = (
    "llama-bench not found: build it with ../shared/tools/build-llama-bench (about 10 minutes on "
    "2 cores), or pass --llama-bench PATH"
)
DEFAULT_PREFIX = Path.home() / ".cache" / "kvscope-peers" / "llama.cpp" / "bin"


@dataclass(frozen=True, slots=True)
class LlamaBenchRun:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_rss_bytes: int  # the llama-bench process's high-water mark (its own rusage)
    wall_s: float  # the whole process: load, warm-up, runs

    @property
    def itl_s(self) -> float:
        return 1.0 / self.decode_tokens_per_s


def find_llama_bench(explicit: str | None) -> Path | None:
    if explicit:
        path = Path(explicit).expanduser()
        return path if path.is_file() else None
    found = shutil.which("llama-bench")
    if found:
        return Path(found)
    candidate = DEFAULT_PREFIX / "llama-bench"
    return candidate if candidate.is_file() else None


def _run(binary: Path, args: list[str]) -> tuple[str, int, float]:
    """stdout, peak RSS in bytes and wall time of one llama-bench process. The peak is the child's
    own VmHWM, read from /proc while it runs: its rusage would not do, because Linux folds the
    forking parent's high-water mark (this process, with a model loaded) into the child's at exec."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{binary.parent}:{env.get('LD_LIBRARY_PATH', '')}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([str(binary), *args], stdout=out, stderr=err, env=env)
        peak = 0
        status_file = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            peak = max(peak, _vm_hwm(status_file))
            time.sleep(0.02)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({proc.returncode}): {err.read().strip()[-300:]}")
        return out.read(), peak, wall


def _vm_hwm(status_file: Path) -> int:
    try:
        text = status_file.read_text()
    except OSError:  # exited between the poll and the read
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_llama_bench(binary: Path, gguf: Path, prompt: int, new_tokens: int, threads: int) -> LlamaBenchRun:
    """One repetition of llama-bench: prefill `prompt` tokens into an empty cache, and decode
    `new_tokens` after `prompt` tokens already in the cache (its -d, "depth"), as kvscope's
    engine decodes them after its prompt. Without the depth llama-bench decodes from an empty
    cache, its attention reading none of the prompt's K/V: on a 1.7B model ~2-4 ms a token of
    attention that kvscope's ITL paid and llama.cpp's did not."""
    args = [
        "-m",
        str(gguf),
        "-p",
        str(prompt),
        "-n",
        str(new_tokens),
        "-d",
        f"0,{prompt}",  # (llama-bench runs each test at each depth: the prefill at 0 is the one read)
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]
    out, peak, wall = _run(binary, args)
    rows = json.loads(out)
    prefill = next(
        r for r in rows if r.get("n_prompt") == prompt and not r.get("n_gen") and not r.get("n_depth")
    )
    decode = next(
        r
        for r in rows
        if r.get("n_gen") == new_tokens and not r.get("n_prompt") and r.get("n_depth") == prompt
    )
    return LlamaBenchRun(float(prefill["avg_ts"]), float(decode["avg_ts"]), peak, wall)


def llama_batch_step(
    binary: Path, gguf: Path, rows: int, depth: int, threads: int, repetitions: int = 5
) -> dict[str, float]:
    """llama.cpp's time for one token and for a batch of `rows` tokens after `depth` tokens in
    its cache (llama-bench -p 1,rows -d depth): what verifying rows - 1 drafts costs it against a
    decode step, in milliseconds, and their ratio."""
    args = ["-m", str(gguf), "-p", f"1,{rows}", "-n", "0", "-d", str(depth), "-t", str(threads)]
    out, _, _ = _run(binary, [*args, "-r", str(repetitions), "-o", "json"])
    by_rows = {r["n_prompt"]: float(r["avg_ns"]) / 1e6 for r in json.loads(out) if r.get("n_depth") == depth}
    one, batch = by_rows[1], by_rows[rows]
    return {"one_row_ms": one, "rows_ms": batch, "rows_vs_one_row": batch / one}


def llama_load_seconds(binary: Path, gguf: Path, threads: int) -> float:
    """llama.cpp's load time, as near as llama-bench shows it: the wall time of a run that only
    loads the model and generates one token without warm-up, less that token."""
    args = ["-m", str(gguf), "-p", "0", "-n", "1", "-t", str(threads), "-r", "1", "--no-warmup", "-o", "json"]
    out, _, wall = _run(binary, args)
    row = json.loads(out)[0]
    return max(0.0, wall - float(row["avg_ns"]) / 1e9)
