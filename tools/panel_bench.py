"""The panel kernels of two builds, interleaved in one process: `python -m tools.panel_bench
--against REV` times this working tree's engine/kernels/native against revision REV's, on a stack
of 1.7B-shaped layers (SmolLM2-1.7B's q|k|v, o, gate|up and down; random blocks, each build
repacking them in its own layout) multiplied by 1, 2 and 5 activation rows. Streamed: the stack is ~10x the L3 cache, so
every pass reads the weights from memory, as a decode or a verify step does; --hot multiplies one
o-projection (2.4 MB) again and again instead (the panels stay in the caches: the arithmetic
alone). The two builds' outputs are compared bit for bit first, and a difference is printed (a
change that means to round otherwise can still be timed).

It measured the prefetch fix in engine/kernels/native/panels.c (GCC had removed every software
prefetch of the panels): 5 rows of Q4_K 25.8 -> 12.9 ms over 12 layers (2 threads, 466 MB).
Run it on an otherwise idle machine: the ratios are one run's, and memory bandwidth moves.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.kernels.gguf_weight import random_blocks
from engine.kernels.huge_pages import huge_page_buffer
from engine.kernels.native import build, row_addresses

SHAPES_17B = ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (out, in) per layer


def _library(sources: Path, out: Path) -> ctypes.CDLL:
    """The AVX-512 build of the sources in `sources`, with the flags `./dev setup` uses."""
    cc = build.compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    flags = [*build.COMMON, *build.X86_VARIANTS["avx512"]]
    files = [str(sources / path.name) for path in build.SOURCES]
    subprocess.run([cc, *flags, *files, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.kvk_panel_bytes.restype = ctypes.c_int64
    lib.kvk_panel_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.kvk_repack_panels.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p  # (t, panels, n, k, x, xs, nr, y, ys)
    lib.kvk_matmul_panels.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64]
    return lib


def _sources_at(rev: str, into: Path) -> Path:
    for path in build.SOURCES:
        relative = path.relative_to(build.HERE.parents[2])
        text = subprocess.run(
            ["git", "show", f"{rev}:{relative}"], check=True, capture_output=True, cwd=build.HERE
        ).stdout
        (into / path.name).write_bytes(text)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", help="the base revision (default HEAD)")
    parser.add_argument("--type", default="Q4_K", choices=["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
    parser.add_argument("--layers", type=int, default=12, help="1.7B-shaped layers (12: 466 MB of Q4_K)")
    parser.add_argument("--rows", default="1,2,5", help="activation rows, comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (medians)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hot", action="store_true", help="one 2048 x 2048 matrix again and again")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # the libraries run on torch's OpenMP pool (build.py)
    qtype = GGMLQuantizationType[args.type]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "base").mkdir()
        libs = {
            "base": _library(_sources_at(args.against, root / "base"), root / "base.so"),
            "new": _library(build.HERE, root / "new.so"),
        }
        # each build repacks the same blocks itself: a change of the panels' layout is timed as it runs
        mats: dict[str, list[tuple[np.ndarray, int, int]]] = {name: [] for name in libs}
        for layer in range(1 if args.hot else args.layers):
            for n, k in SHAPES_17B[1:2] if args.hot else SHAPES_17B:
                blocks = random_blocks(qtype, n, k, seed=layer)
                table = row_addresses(blocks)
                for name, lib in libs.items():
                    panels = huge_page_buffer(lib.kvk_panel_bytes(int(qtype), n, k))
                    if lib.kvk_repack_panels(int(qtype), table.ctypes.data, n, k, panels.ctypes.data) != 0:
                        raise SystemExit(f"the {name} build does not repack {args.type}")
                    mats[name].append((panels, n, k))
        if args.hot:
            mats = {name: held * 96 for name, held in mats.items()}
        weights = sum(n * k for _, n, k in mats["base"])
        rows = [int(r) for r in args.rows.split(",")]
        xs = {r: torch.randn(r, max(k for _, _, k in mats["base"])) for r in rows}
        ys = {r: torch.empty(r, max(n for _, n, _ in mats["base"])) for r in rows}

        def one_pass(name: str, r: int) -> float:
            lib = libs[name]
            start = time.perf_counter()
            for panels, n, k in mats[name]:
                lib.kvk_matmul_panels(
                    int(qtype), panels.ctypes.data, n, k, xs[r].data_ptr(), k, r, ys[r].data_ptr(), n
                )
            return time.perf_counter() - start

        for r in rows:  # the same bits from both builds
            outs = []
            for name, lib in libs.items():
                panels, n, k = mats[name][-1]
                y = torch.empty(r, n)
                lib.kvk_matmul_panels(
                    int(qtype), panels.ctypes.data, n, k, xs[r].data_ptr(), k, r, y.data_ptr(), n
                )
                outs.append(y)
            if not torch.equal(*outs):
                print(f"{r} rows: the builds' outputs differ", file=sys.stderr)
        times: dict[tuple[str, int], list[float]] = {(name, r): [] for name in libs for r in rows}
        for i in range(args.rounds):
            for r in rows:
                for name in ("base", "new") if i % 2 == 0 else ("new", "base"):
                    times[(name, r)].append(one_pass(name, r))
        held = sum(p.nbytes for p, _, _ in (mats["base"][:1] if args.hot else mats["base"])) / 1e6
        print(
            f"{args.type} panels, {held:.0f} MB {'hot' if args.hot else 'streamed'}, {args.threads} threads"
        )
        for r in rows:
            b, w = statistics.median(times[("base", r)]), statistics.median(times[("new", r)])
            print(
                f"{r} rows: {args.against} {b * 1e3:.2f} ms ({r * weights / b / 1e9:.0f} G products/s), "
                f"this tree {w * 1e3:.2f} ms ({r * weights / w / 1e9:.0f}): {w / b:.3f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
