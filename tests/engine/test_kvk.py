"""kvk, the C kernels for GGUF blocks: for every type and every build of this machine (AVX-512,
AVX2, portable C), dequantization bit for bit gguf-py's, the kernel's (code, a, b) reading of a
block equal to it, the 8-bit-activation product equal to the exact product of the same rounded
activations, the float32 path equal to a float64 reference, and each output row the same whatever
the rows beside it (alone, batched, in any tile)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from activation_codes import rounded_activations
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from onednn_capped import run_capped

from engine.kernels import native
from engine.kernels.gguf_weight import KVK_TYPES, GGUFWeight, random_blocks
from engine.kernels.native import Kvk, build, row_addresses

QUANTIZED = sorted((t for t in KVK_TYPES if t not in (Q.F16, Q.BF16)), key=int)
SUPER_BLOCK = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS}  # 256 weights, activations per 256


def _variants() -> list[Kvk]:
    """Every build of this source that this CPU runs (./dev setup builds them all)."""
    libs = []
    for variant in native.cpu_variants():
        path = build.PACKAGE_LIB / build.library_name(variant)
        if not path.exists():
            path = build.build(variant, native._cache_dir())
        lib = ctypes.CDLL(str(path))
        native._declare(lib)
        libs.append(Kvk(lib, variant, path))
    return libs


VARIANTS = _variants()


@pytest.fixture(params=VARIANTS, ids=lambda k: k.variant)
def kvk(request):
    return request.param


def widths(qtype):
    return (256, 512) if qtype in SUPER_BLOCK else (32, 96, 576)


def product_widths(qtype):
    """Whole groups of 256 inputs, and for the 32-weight types rows whose last group ends a block
    (96: 3), a chunk (320: 2; 576, the packaged model's rows) or a half group (384: 4) in, or past
    a half with one chunk left (448: 6)."""
    return (512,) if qtype in SUPER_BLOCK or qtype in (Q.F16, Q.BF16) else (512, 96, 320, 384, 448, 576)


def test_this_machine_runs_its_best_build():
    lib = native.kernels()
    assert lib is not None, native.status()
    assert lib.variant == native.cpu_variants()[0]
    assert lib.lib.kvk_isa() == (512 if lib.variant == "avx512" else 0)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_dequantization_is_gguf_bit_for_bit(kvk, qtype):
    for cols in widths(qtype):
        blocks = random_blocks(qtype, 37, cols, seed=cols)
        want = dequantize(blocks, qtype).reshape(37, cols).astype(np.float32)
        got = kvk.dequantize_rows(qtype, row_addresses(blocks), cols, torch.arange(37)).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        bf16 = kvk.dequantize_bf16(qtype, row_addresses(blocks), cols)
        assert torch.equal(bf16, torch.from_numpy(want).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_the_kernels_codes_and_scales_are_the_blocks_weights(kvk, qtype):
    """w = a * code + b per sub-block: what the integer dot products compute with."""
    weights, size = GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, 4, weights, seed=1)
    want = dequantize(blocks, qtype).reshape(4, weights).astype(np.float64)
    subs = {Q.Q2_K: 16, Q.Q3_K: 16, Q.Q6_K: 16}.get(qtype, 8 if qtype in SUPER_BLOCK else 1)
    for row in range(4):
        codes, a, b = kvk.unpack_block(qtype, blocks[row], weights, subs)
        sub = weights // subs
        mine = np.repeat(a.astype(np.float64), sub) * codes + np.repeat(b.astype(np.float64), sub)
        assert np.allclose(mine, want[row], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_the_integer_product_is_exact_for_its_rounded_activations(kvk, qtype):
    for cols in product_widths(qtype):
        blocks = random_blocks(qtype, 64, cols, seed=2)
        weights = dequantize(blocks, qtype).reshape(64, cols).astype(np.float64)
        x = torch.randn(3, cols)
        want = rounded_activations(x) @ weights.T
        got = kvk.matmul(qtype, row_addresses(blocks), cols, x).numpy()
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), cols
        # and the rounding itself costs what ~16 bits of each group's range cost
        exact = x.double().numpy() @ weights.T
        assert np.abs(got - exact).max() <= 2e-4 * np.abs(exact).max(), cols


@pytest.mark.parametrize("qtype", [*QUANTIZED, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_the_float_path_is_the_float64_product(kvk, qtype):
    cols = 512
    blocks = random_blocks(qtype, 40, cols, seed=3)
    weights = dequantize(blocks, qtype).reshape(40, cols).astype(np.float64)
    x = torch.randn(5, cols)
    got = kvk.matmul(qtype, row_addresses(blocks), cols, x, exact=True).numpy()
    want = x.double().numpy() @ weights.T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_the_vector_quantizer_writes_the_portable_loops_bytes(kvk, qtype):
    """Activations are quantized by intrinsics where the build has them, by a scalar loop
    elsewhere; both must write the same planes, scales and sums or the builds (and the reference
    the tests above check) would round differently. Rows with heavy tails, exact ties at .5,
    zeros, a NaN and huge values."""
    cols = 512
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, cols, generator=gen)
    x[1] *= torch.rand(cols, generator=gen) ** 8 * 100  # heavy-tailed
    x[2] = torch.arange(cols) % 7 - 3.5  # halves: round to nearest even
    x[3] = 0.0
    x[4, [20, 250]] = float("nan")  # in the last 16 inputs of a block of 32 and of 256
    x[5, ::9] = 3e38
    vector, scalar = kvk.quantize_rows(qtype, x), kvk.quantize_rows(qtype, x, scalar=True)
    assert np.array_equal(vector, scalar)


@pytest.mark.parametrize("qtype", [*QUANTIZED, Q.F16], ids=lambda t: t.name)
def test_a_row_is_the_same_alone_and_among_others(kvk, qtype):
    """Batch invariance by construction: threads split the weight rows, never a dot product, and
    every tile shape runs the same operations per output."""
    for cols in product_widths(qtype):
        blocks = random_blocks(qtype, 131, cols, seed=4)  # not a multiple of the 4-row tiles
        x = torch.randn(23, cols)
        for exact in (False, True):
            together = kvk.matmul(qtype, row_addresses(blocks), cols, x, exact=exact)
            for r in (0, 7, 22):
                alone = kvk.matmul(qtype, row_addresses(blocks), cols, x[r : r + 1].contiguous(), exact=exact)
                assert torch.equal(alone[0], together[r])
            assert torch.equal(
                kvk.matmul(qtype, row_addresses(blocks), cols, x[:5].contiguous(), exact=exact), together[:5]
            )


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_a_prompt_in_blocks_of_rows_has_the_bits_of_one_block(kvk, qtype):
    """A prompt's activation rows go through the weights in blocks that fit the L2 cache
    (row_block): every block size gives each output the same bits, and a row its bits alone."""
    cols = product_widths(qtype)[-1]
    blocks = random_blocks(qtype, 9, cols, seed=5)
    x = torch.randn(37, cols)
    try:
        kvk.lib.kvk_set_row_block_bytes(1 << 40)  # one block
        whole = kvk.matmul(qtype, row_addresses(blocks), cols, x)
        for block_bytes in (1, 20 * cols, 60 * cols):  # blocks of one tile's rows, of 2 tiles, of 5
            kvk.lib.kvk_set_row_block_bytes(block_bytes)
            assert torch.equal(kvk.matmul(qtype, row_addresses(blocks), cols, x), whole)
    finally:
        kvk.lib.kvk_set_row_block_bytes(0)
    alone = kvk.matmul(qtype, row_addresses(blocks), cols, x[36:].contiguous())
    assert torch.equal(alone[0], whole[36])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_row_map_reads_the_rows_it_names(kvk, qtype):
    cols = 256
    blocks = random_blocks(qtype, 48, cols, seed=5)
    order = np.random.default_rng(6).permutation(48).astype(np.int32)
    x = torch.randn(4, cols)
    assert torch.equal(
        kvk.matmul(qtype, row_addresses(blocks, order), cols, x),
        kvk.matmul(qtype, row_addresses(blocks), cols, x)[:, order],
    )
    bf16 = kvk.dequantize_bf16(qtype, row_addresses(blocks, order), cols)
    assert torch.equal(bf16, kvk.dequantize_bf16(qtype, row_addresses(blocks), cols)[order])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_a_permuted_table_is_read_in_address_order_with_the_same_bits(qtype):
    """Llama's q/k rows as transformers orders them: a decode row reads them as the file holds
    them (kvk_matmul_visit) and writes each output where the table puts it, the bits of the
    permuted table read in its own order."""
    cols, n = 512, 128
    blocks = random_blocks(qtype, n, cols, seed=8)
    head = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])  # transformers' q/k order
    order = np.concatenate([head, head + 64])
    storage = GGUFWeight(qtype, blocks, cols, row_map=order)
    in_order = GGUFWeight(qtype, blocks, cols)
    assert storage.visit is not None and np.array_equal(
        storage.row_table[storage.visit], np.sort(storage.row_table)
    )
    assert in_order.visit is None
    kvk = native.kernels()
    for rows in (1, 5, 23):  # a decode row, a speculative round, a prompt's tiles (table order)
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        unvisited = kvk.matmul(qtype, storage.row_table, cols, x)
        assert torch.equal(storage.matmul("kvk", x), unvisited)
        assert torch.equal(unvisited, in_order.matmul("kvk", x)[:, order])
    fused = GGUFWeight.cat([storage, in_order])
    assert fused.visit is not None
    x = torch.randn(1, cols)
    assert torch.equal(
        fused.matmul("kvk", x), torch.cat([storage.matmul("kvk", x), in_order.matmul("kvk", x)], 1)
    )


def test_the_builds_agree_with_each_other():
    """The instruction sets sum in different orders; their products agree to float32 rounding."""
    if len(VARIANTS) < 2:
        pytest.skip("one build on this machine")
    blocks = random_blocks(Q.Q4_K, 64, 1024, seed=7)
    x = torch.randn(3, 1024)
    results = [lib.matmul(Q.Q4_K, row_addresses(blocks), 1024, x) for lib in VARIANTS]
    for other in results[1:]:
        assert torch.allclose(other, results[0], rtol=1e-4, atol=1e-5)


def test_shapes_the_kernel_cannot_take_are_refused(kvk):
    blocks = random_blocks(Q.Q4_K, 4, 256)  # alive while the table points into it
    with pytest.raises(RuntimeError, match="refused"):
        kvk.matmul(Q.Q4_K, row_addresses(blocks), 200, torch.randn(1, 200))
    assert kvk.row_bytes(Q.Q4_K, 250) == -1 and not kvk.supported(int(Q.IQ2_XXS))
    with pytest.raises(ValueError, match="bytes"):
        GGUFWeight(Q.Q4_0, random_blocks(Q.Q4_0, 4, 64), 96, lib=kvk)


def test_the_storage_multiplies_embeds_and_counts_as_the_file():
    blocks = random_blocks(Q.Q6_K, 32, 256, seed=8)
    storage = GGUFWeight(Q.Q6_K, blocks, 256)
    x = torch.randn(2, 256)
    want = x.double() @ torch.from_numpy(dequantize(blocks, Q.Q6_K).reshape(32, 256)).double().T
    assert torch.allclose(
        storage.matmul("kvk", x).double(), want, rtol=0, atol=2e-4 * float(want.abs().max())
    )
    assert torch.allclose(storage.exact_matmul(x).double(), want, rtol=1e-5, atol=1e-6)
    dense = storage.matmul("dense-bf16", x).double()
    assert torch.allclose(dense, want, rtol=0, atol=2e-2 * float(want.abs().max()))
    assert torch.equal(storage.rows(torch.tensor([3, 9])), storage.dequantize()[[3, 9]])
    assert storage.nbytes == blocks.nbytes and storage.tensors()[0].data_ptr() == blocks.ctypes.data


def test_tensors_of_one_type_fuse_into_one_table_of_their_rows():
    """A fused q/k/v over three separate tensors: one kernel call, every output as each tensor's
    own, and nothing copied (the table points into the parts)."""
    parts = [GGUFWeight(Q.Q4_K, random_blocks(Q.Q4_K, n, 256, seed=n), 256) for n in (32, 8, 8)]
    fused = GGUFWeight.cat(parts)
    x = torch.randn(3, 256)
    assert torch.equal(fused.matmul("kvk", x), torch.cat([p.matmul("kvk", x) for p in parts], 1))
    assert torch.equal(fused.exact_matmul(x), torch.cat([p.exact_matmul(x) for p in parts], 1))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert fused.nbytes == sum(p.nbytes for p in parts) and fused.out_features == 48
    assert np.array_equal(fused.dequantizable_copy(), np.concatenate([p.parts[0] for p in parts]))


def test_anything_but_a_row_table_is_refused_not_read_as_addresses():
    blocks = random_blocks(Q.Q4_0, 8, 64)
    kvk = native.kernels()
    with pytest.raises(TypeError, match="row addresses"):
        kvk.matmul(Q.Q4_0, blocks, 64, torch.randn(1, 64))  # the blocks themselves
    with pytest.raises(ValueError, match="float32"):
        kvk.matmul(Q.Q4_0, row_addresses(blocks), 64, torch.randn(1, 64, dtype=torch.float64))
    with pytest.raises(IndexError):
        kvk.dequantize_rows(Q.Q4_0, row_addresses(blocks), 64, torch.tensor([8]))


LONE_ROW_CHECK = """
import torch
from gguf import GGMLQuantizationType as Q
from engine.kernels.gguf_weight import GGUFWeight, random_blocks
storage = GGUFWeight(Q.Q4_K, random_blocks(Q.Q4_K, 576, 1536, seed=5), 1536)
x = torch.randn(97, 1536, generator=torch.Generator().manual_seed(7))
together = storage.matmul("dense-bf16", x)
alone = torch.cat([storage.matmul("dense-bf16", x[r : r + 1]) for r in range(x.shape[0])])
among_few = torch.cat([storage.matmul("dense-bf16", x[r : r + 3])[:1] for r in range(x.shape[0])])
print(int((alone != together).any(1).sum()))
print(int((among_few != together).any(1).sum()))
"""


@pytest.mark.parametrize("isa", ["ALL", "AVX512_CORE", "AVX2"])
def test_the_dense_kernel_gives_a_row_its_own_bits_alone_or_among_others(isa):
    """A prompt's last row can meet the dense kernel alone (a prefix-cache hit leaves it, or a
    one-row last chunk): it must get the bits it gets with the rest of its prompt. oneDNN picks
    its GEMM's code path by the row count (a GEMV for one row; without AVX512-BF16 other paths at
    2-3 and 8-32 rows), whose last bits differ: a greedy reply under the serve load changed, and
    CI's CPU failed where this one passed. Each of oneDNN's instruction sets this CPU can run,
    capped in a fresh process (ONEDNN_MAX_CPU_ISA is read once, at oneDNN's start)."""
    differing = run_capped(LONE_ROW_CHECK, isa)
    assert differing == ["0", "0"], f"rows differing alone, among 3: {differing}"


def test_the_dense_kernel_a_slice_at_a_time_is_the_whole_layers_product(monkeypatch):
    """The dense kernel decodes a few rows at a time into a small buffer (the process never holds
    a whole layer's bfloat16 copy); each output is the bfloat16 GEMM of the whole row."""
    import engine.kernels.gguf_weight as gguf_weight

    blocks = random_blocks(Q.Q4_K, 40, 512, seed=3)
    storage = GGUFWeight(Q.Q4_K, blocks, 512)
    x = torch.randn(5, 512)
    whole = torch.nn.functional.linear(x.to(torch.bfloat16), storage.dequantize(torch.bfloat16)).float()
    monkeypatch.setattr(gguf_weight, "DENSE_SLICE_WEIGHTS", 512 * 7)  # 7 rows a slice: 6 slices, one short
    # the scratch is this thread's, shared with every earlier test: start this one from none
    monkeypatch.setattr(gguf_weight._SCRATCH, "buf", None, raising=False)
    assert torch.equal(storage.matmul("dense-bf16", x), whole)
    assert gguf_weight._SCRATCH.buf.numel() <= 512 * 7


def test_the_float16_pool_write_rounds_as_torch_does(kvk):
    """layer_ops.c's K/V write into a float16 pool (kvk_to_f16: vcvtps2ph, and the portable
    loop the other builds and every row's tail take) gives torch's .to(torch.float16) bits:
    ties to even, subnormals, overflow to infinity, NaN."""
    special = torch.tensor(
        [0.0, -0.0, 1.0, 65504.0, 65520.0, -65520.0, 1e9, 2.0**-24, 2.0**-25, 2.0**-26, 3 * 2.0**-25,
         1e-8, -1e-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, float("inf"), float("-inf")],
        dtype=torch.float32,
    )  # fmt: skip
    values = torch.cat([special, torch.randn(4000) * torch.logspace(-9, 5, 4000)])
    for n in (len(values), 13):  # whole vectors and a tail, and a short run of the loop alone
        x = values[:n].contiguous()
        out = torch.empty(n, dtype=torch.int16)
        assert kvk.lib.kvk_to_f16(x.data_ptr(), n, out.data_ptr()) == 0
        assert torch.equal(out, x.to(torch.float16).view(torch.int16))
    nan = torch.tensor([float("nan")] * 16)
    out = torch.empty(16, dtype=torch.int16)
    kvk.lib.kvk_to_f16(nan.data_ptr(), 16, out.data_ptr())
    assert out.view(torch.float16).isnan().all()
