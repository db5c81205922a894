"""llama.cpp's `llama-bench` as a peer in the same run: the same GGUF file, prompt length, new
tokens and threads. Found on PATH, at --llama-bench PATH, or where ../shared/tools/build-llama-bench
puts it; absent, the bench says so and how to build it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


def run_llama_bench(binary: Path, gguf: Path, prompt: int, new_tokens: int, threads: int) -> LlamaBenchRun:
    """One repetition of llama-bench: prefill `prompt` tokens, then decode `new_tokens`."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{binary.parent}:{env.get('LD_LIBRARY_PATH', '')}"
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(new_tokens), "-t", str(threads)]
    cmd += ["-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
    rows = json.loads(proc.stdout)
    prefill = next(r for r in rows if r.get("n_prompt") == prompt and not r.get("n_gen"))
    decode = next(r for r in rows if r.get("n_gen") == new_tokens and not r.get("n_prompt"))
    return LlamaBenchRun(float(prefill["avg_ts"]), float(decode["avg_ts"]))
