"""Q4_0, Q4_1, Q4_K and Q6_K repacked into panels of 16 rows (engine/kernels/native/panels.c): the panels hold the file's
codes and scales (gguf's dequantization, bit for bit), their product is the exact product of the
same rounded activations, a row's outputs are the same bits alone, among others and in any block
of rows, and a loaded model's linear layers run on them (not its LM head), the file's pages handed
back."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from activation_codes import rounded_activations
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from engine.kernels import native
from engine.kernels.gguf_weight import GGUFWeight, file_mapped, random_blocks, release_pages
from engine.kernels.native import row_addresses

KVK = native.kernels()
pytestmark = pytest.mark.skipif(
    KVK is None or KVK.lib.kvk_panel_bytes(int(Q.Q4_0), 16, 32) < 0,
    reason="this build multiplies no panels (they need AVX-512 VNNI)",
)


PANEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


def widths(qtype: Q) -> tuple[int, ...]:
    """Whole groups of 256 inputs and (32-weight types) a shorter last group."""
    return (256, 768) if qtype in (Q.Q4_K, Q.Q6_K) else (512, 96, 320, 576)


def panel_matmul(qtype: Q, panels: np.ndarray, n: int, k: int, x: torch.Tensor) -> torch.Tensor:
    assert KVK is not None
    y = torch.empty(x.shape[0], n)
    status = KVK.lib.kvk_matmul_panels(
        int(qtype), panels.ctypes.data, n, k, x.data_ptr(), k, x.shape[0], y.data_ptr(), n
    )
    assert status == 0
    return y


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, width", [(16, 0), (37, 1), (50, -1), (5, 0)])
def test_panels_hold_the_files_weights_bit_for_bit(qtype, n, width):
    assert KVK is not None
    k = widths(qtype)[width]
    blocks = random_blocks(qtype, n, k, seed=1)
    order = np.random.default_rng(2).permutation(n)  # a permuted table (Llama's q/k rows)
    panels = KVK.repack_panels(int(qtype), row_addresses(blocks, order), k)
    # the file's bytes; Q4_K's 6-bit scales and minimums as bytes: 4 more a row and super-block
    extra = 4 * k // 256 if qtype == Q.Q4_K else 0
    assert panels is not None and panels.nbytes == -(-n // 16) * 16 * (blocks.shape[1] + extra)
    want = dequantize(blocks, qtype).reshape(n, k)[order]
    assert np.array_equal(KVK.panel_weights(int(qtype), panels, n, k).numpy(), want)


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_the_panel_product_is_exact_for_its_rounded_activations(qtype):
    for k in widths(qtype):
        check_the_product(qtype, k)


def check_the_product(qtype: Q, k: int) -> None:
    assert KVK is not None
    n = 40  # a last panel of 8 rows
    blocks = random_blocks(qtype, n, k, seed=3)
    panels = KVK.repack_panels(int(qtype), row_addresses(blocks), k)
    assert panels is not None
    weights = dequantize(blocks, qtype).reshape(n, k).astype(np.float64)
    for rows in (1, 5, 8, 13, 21):  # 21: a prompt's rows (Q4_K: two panels a pass)
        x = torch.randn(rows, k)
        want = rounded_activations(x) @ weights.T
        got = panel_matmul(qtype, panels, n, k, x).numpy()
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), (k, rows)
        # the row kernel rounds the activations the same way: the same product to float32 rounding
        rows_kernel = KVK.matmul(qtype, row_addresses(blocks), k, x).numpy()
        assert np.abs(got - rows_kernel).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_a_row_is_the_same_alone_among_others_and_in_any_block_of_rows(qtype):
    """Threads take whole panels, a tile of rows runs each row's operations unchanged: a decode
    row, a speculative round's few rows and a prompt's rows (Q4_K's: two panels a pass, a thread's
    odd last panel alone) get the same bits."""
    assert KVK is not None
    n, k = 70, widths(qtype)[-1]
    blocks = random_blocks(qtype, n, k, seed=4)
    panels = KVK.repack_panels(int(qtype), row_addresses(blocks), k)
    assert panels is not None
    x = torch.randn(37, k)  # tiles of 8 and a remainder of 5
    try:
        KVK.lib.kvk_set_row_block_bytes(1 << 40)
        together = panel_matmul(qtype, panels, n, k, x)
        for block_bytes in (1, 10 * k, 40 * k):  # blocks of one tile's rows and more
            KVK.lib.kvk_set_row_block_bytes(block_bytes)
            assert torch.equal(panel_matmul(qtype, panels, n, k, x), together)
    finally:
        KVK.lib.kvk_set_row_block_bytes(0)
    for r in (0, 8, 36):
        assert torch.equal(panel_matmul(qtype, panels, n, k, x[r : r + 1].contiguous())[0], together[r])
    for rows in range(2, 10):
        assert torch.equal(panel_matmul(qtype, panels, n, k, x[:rows].contiguous()), together[:rows])


def test_a_storage_on_panels_multiplies_them_and_holds_them_alone():
    assert KVK is not None
    n, k = 48, 256
    blocks = random_blocks(Q.Q4_0, n, k, seed=5)
    storage = GGUFWeight(Q.Q4_0, blocks, k, lib=KVK)
    x = torch.randn(3, k)
    rows_kernel = storage.matmul("kvk", x)
    assert not file_mapped(blocks)
    assert storage.use_panels(release_file_pages=True)  # not a file: nothing handed back
    assert np.array_equal(blocks, random_blocks(Q.Q4_0, n, k, seed=5))
    on_panels = storage.matmul("kvk", x)
    assert torch.allclose(on_panels, rows_kernel, rtol=0, atol=2e-6 * float(rows_kernel.abs().max()))
    assert [t.numel() for t in storage.tensors()] == [storage.panels.nbytes] == [blocks.nbytes]
    # the kernel table's probe copy runs on panels too, and the exact path still reads the rows
    import copy

    assert copy.deepcopy(storage).panels is not None
    exact = storage.exact_matmul(x)
    assert torch.allclose(exact, rows_kernel, rtol=0, atol=1e-3 * float(rows_kernel.abs().max()))
    other = GGUFWeight(Q.Q8_0, random_blocks(Q.Q8_0, 16, 256), 256, lib=KVK)
    assert not other.use_panels() and other.panels is None  # no panels for this type


def resident_file_kib() -> int:
    """The process's resident pages of mapped files (Linux's /proc), in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED"), reason="no madvise here")
def test_handing_back_a_files_pages_drops_them_and_keeps_what_it_reads(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(6).integers(0, 256, size=32 * 2**20 + 100, dtype=np.uint8)
    data.tofile(path)
    view = np.memmap(path, mode="c").view(np.ndarray)[50:]
    assert file_mapped(view) and int(view.sum()) == int(data[50:].sum())  # every page read in
    held = resident_file_kib()
    release_pages(view)
    assert held - resident_file_kib() >= 30 * 1024  # the 32 MiB handed back
    assert np.array_equal(view, data[50:])  # and read again from the file


def test_a_loaded_models_linears_run_on_panels_and_its_head_on_the_files_rows(tmp_path):
    from gguf_files import write_tiny_llama
    from tiny_models import IdTokenizer

    from engine.kernels.linear import KernelHead
    from engine.kernels.policy import KernelPolicy
    from engine.model.gguf_native import load_native
    from engine.model.loaded import LoadedModel

    types = dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q.Q4_0
    )
    path = write_tiny_llama(tmp_path / "tiny.gguf", types, output_type=Q.Q4_0)
    model, _ = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    loaded = LoadedModel.from_model(model, IdTokenizer(256), name="tiny", source=str(path), scheme="native")
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, KernelHead) and head.storage.panels is None
    storages = {
        id(s): s
        for m in loaded.model.modules()
        if hasattr(m, "storages") and m is not head
        for s in m.storages()
        if isinstance(s, GGUFWeight)
    }
    assert storages and all(s.panels is not None for s in storages.values())
    # what the panels hold, said against the file's rows (Q4_0's panels are its bytes reordered;
    # rows past a multiple of 16 are padding)
    file = sum(s.file_bytes() for s in storages.values())
    panels = sum(s.panels.nbytes for s in storages.values())
    (note,) = [n for n in loaded.info.notes if "Q4_0 linears" in n]
    assert ("the same bytes" in note) == (panels == file) and "panels of 16 rows" in note


def test_the_q4_k_panels_note_says_what_they_add_to_the_files_bytes():
    """Q4_K's 6-bit scales unpacked to bytes: 148 bytes a super-block's row in place of 144."""
    from engine.kernels.linear import KernelLinear, repack_for_kernels, repacked_notes
    from engine.kernels.policy import KernelPolicy

    n, k = 32, 512
    storage = GGUFWeight(Q.Q4_K, random_blocks(Q.Q4_K, n, k), k)
    model = torch.nn.Sequential(KernelLinear(storage, None, KernelPolicy()))
    repack_for_kernels(model)
    assert storage.panels is not None and storage.panels.nbytes == storage.file_bytes() * 148 // 144
    (note,) = repacked_notes(model)
    assert note.startswith("Q4_K linears (x1) repacked") and "+2.8% on the file's bytes" in note


def test_two_threads_multiplying_at_once_each_get_their_own_product():
    """The activation codes live in each calling thread's own scratch (the engine's thread and a
    measuring worker may multiply at once)."""
    import threading

    assert KVK is not None
    n, k = 256, 4096  # calls long enough (~1 ms) to overlap
    blocks = random_blocks(Q.Q4_0, n, k, seed=7)
    panels = KVK.repack_panels(int(Q.Q4_0), row_addresses(blocks), k)
    assert panels is not None
    inputs = [torch.randn(rows, k) for rows in (5, 48)]
    wanted = [panel_matmul(Q.Q4_0, panels, n, k, x) for x in inputs]
    wrong: list[int] = []

    def work(i: int) -> None:
        for _ in range(100):
            if not torch.equal(panel_matmul(Q.Q4_0, panels, n, k, inputs[i]), wanted[i]):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_the_panel_kernels_keep_their_software_prefetches(tmp_path):
    """The panels' build as the library makes it still asks for the bytes ahead: GCC once removed
    every call of a prefetching helper it judged free of effects, and nothing else shows that."""
    import platform
    import subprocess

    from engine.kernels.native import build

    cc = build.compiler()
    if cc is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("no C compiler, or not x86-64")
    flags = [f for f in build.COMMON if f not in ("-shared", "-fPIC")] + build.X86_VARIANTS["avx512"]
    source = build.HERE / "panels.c"
    done = subprocess.run(
        [cc, *flags, "-S", str(source), "-o", str(tmp_path / "panels.s")], capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assembly = (tmp_path / "panels.s").read_text()
    kernels = assembly.count("vpdpwssd")
    assert kernels > 0, "the AVX-512 VNNI panel kernels were built"
    assert assembly.count("prefetcht0") >= 3, "each of the three panel kernels prefetches"
