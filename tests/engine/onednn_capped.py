"""Run a snippet in a fresh Python with oneDNN capped at an instruction set.

ONEDNN_MAX_CPU_ISA is read once, when oneDNN starts, so a cap needs its own process. Capping
stands in for the CPUs CI may run on (AVX512_CORE: AVX-512 without BF16 or VNNI; AVX2)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_capped(code: str, isa: str) -> list[str]:
    """The lines `code` printed, run with oneDNN capped at `isa`; fails on a non-zero exit."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()
