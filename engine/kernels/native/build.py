"""Build kvscope's C kernels (kvk.c: GGUF block matmuls; attention.c: paged attention; layer_ops.c:
the residual add + RMSNorm and RoPE of models on kvk; panels.c: Q4_0, Q4_1, Q4_K, Q6_K
repacked 16 rows side by side) into one shared library per instruction set.

    python -m engine.kernels.native.build [--out DIR] [--variants avx512,avx2,portable]

`./dev setup` runs it into the package folder (engine/kernels/native/lib/, not in git) and the
frozen app's build carries what it made; engine.kernels.native loads the best variant this CPU
runs. A library's name carries the hash of the source it was built from, so a stale build is never
loaded. Without a C compiler nothing is built and the engine says it runs the slower path.

Why a plain C library over ctypes rather than a torch C++ extension: it compiles in seconds
(no torch headers), links no torch ABI, and its OpenMP regions run on the very thread pool torch
uses (torch's wheels ship libgomp.so.1, and a library asking for that soname gets the one already
loaded), so `torch.set_num_threads` governs both and they never compete for the cores. Why not
ggml through a binding: ggml-python on PyPI is an sdist that builds all of ggml (minutes), and
its graph API costs a context and a graph per matmul call from Python; its kernels round the
activations to 8 bits (too coarse for the product's quality bound, kvk.c), and the kernels here
keep each output's arithmetic independent of the batch (a sequence's tokens never depend on its
neighbours), which ggml's tiling does not promise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "kvk.c", HERE / "attention.c", HERE / "layer_ops.c", HERE / "panels.c")
PACKAGE_LIB = HERE / "lib"

# Compiler flags per variant. -ffp-contract=off: the dequantization must round where gguf-py does
# (no multiply-add fused behind our back); the kernels fuse explicitly where they mean to.
COMMON = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", "-std=gnu11"]
X86_VARIANTS = {
    "avx512": ["-march=x86-64-v4", "-mavx512vnni"],
    "avx2": ["-march=x86-64-v3"],
    "portable": [],
}
ARM_VARIANTS = {"portable": ["-march=armv8-a"]}


def source_hash() -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def variants_for_machine() -> dict[str, list[str]]:
    return X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else ARM_VARIANTS


def library_name(variant: str, digest: str | None = None) -> str:
    return f"kvk-{variant}-{digest or source_hash()}.so"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(variant: str, out_dir: Path, cc: str | None = None) -> Path:
    """Compile one variant into out_dir (atomically: a half-written library is never loaded)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = variants_for_machine()[variant]
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name(variant)
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so.tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        cmd = [cc, *COMMON, *flags, *map(str, SOURCES), "-o", str(tmp_path), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        tmp_path.replace(target)
    finally:
        tmp_path.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_LIB)
    parser.add_argument("--variants", default=",".join(variants_for_machine()))
    args = parser.parse_args(argv)
    if compiler() is None:
        print(
            "kvk: no C compiler found; the engine will run GGUF weights on its slower torch path",
            file=sys.stderr,
        )
        return 0
    for old in args.out.glob("kvk-*.so"):  # builds of older sources
        if not old.name.endswith(f"-{source_hash()}.so"):
            old.unlink(missing_ok=True)
    for variant in args.variants.split(","):
        if (args.out / library_name(variant.strip())).exists():
            continue  # this source's build is there (./dev setup runs this every time)
        path = build(variant.strip(), args.out)
        print(
            f"kvk: built {path.relative_to(args.out.parent) if path.is_relative_to(args.out.parent) else path}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
