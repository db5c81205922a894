"""Weights as a kernel choice: every kernel of a storage multiplies by the same weights, the packed
int4 layout reads back, fused projections equal the separate layers, and each sequence's rows take
the kernel of their own row count (so a request's tokens do not depend on its neighbours)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import make_tiny_llama

from engine.config import SamplingParams
from engine.core.runner import _kernel_segments
from engine.core.sequence import Sequence
from engine.kernels import int4_layout
from engine.kernels import policy as policy_module
from engine.kernels.linear import KernelLinear, fuse_projections
from engine.kernels.packing import quantize_int4_groups, quantize_int8_per_row
from engine.kernels.policy import ROW_BUCKETS, KernelPolicy, table_key
from engine.kernels.weights import DenseWeight, Int4GroupWeight, Int8RowWeight, Q8BlockWeight


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def storages(n: int = 192, k: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    scales = (w.reshape(n, k // 32, 32).abs().amax(-1) / 127).half()
    q8 = torch.round(w.reshape(n, k // 32, 32) / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return {
        "int8-row": Int8RowWeight(*quantize_int8_per_row(w)),
        "int4-g32": Int4GroupWeight(*quantize_int4_groups(w, 32)),
        "q8_0": Q8BlockWeight(q8.reshape(n, k), scales),
        "dense-bf16": DenseWeight(w.to(torch.bfloat16)),
        "dense-fp32": DenseWeight(w),
    }


@pytest.mark.parametrize("kind", ["int8-row", "int4-g32", "q8_0", "dense-bf16", "dense-fp32"])
def test_every_kernel_multiplies_by_the_storages_dequantized_weights(kind):
    storage = storages()[kind]
    x = torch.randn(5, storage.in_features, generator=torch.Generator().manual_seed(1))
    want = x @ storage.dequantize(torch.float32).t()
    for kernel in storage.kernels():
        got = storage.matmul(kernel, x)
        assert got.shape == want.shape and got.dtype == x.dtype
        # float32 paths are exact up to summation order; the others round activations to bf16
        limit = 1e-5 if kernel == "dense-fp32" else 1.5e-2
        assert relative_error(got, want) < limit, (kind, kernel)


@pytest.mark.parametrize("rows", [64, 80, 192])  # whole blocks, a padded tail, several blocks
def test_int4_codes_read_back_from_the_packed_layout(rows):
    w = torch.randn(rows, 64)
    codes, scales, zeros = quantize_int4_groups(w, 32)
    storage = Int4GroupWeight(codes, scales, zeros)
    assert storage.out_features == rows and storage.padded_rows % int4_layout.rows_multiple() == 0
    assert torch.equal(storage.codes().to(torch.int32), codes)
    got_scales, got_zeros = storage.group_scales()
    assert torch.equal(got_scales, scales.to(torch.bfloat16).float())
    # a zero moves by at most its group's scale-rounding shift (8 codes' worth), then is rounded
    shift = 8 * scales.abs() * 2**-8
    assert torch.all((got_zeros - zeros).abs() <= shift + zeros.abs() * 2**-8)
    assert storage.matmul("packed", torch.randn(3, 64)).shape == (3, rows)


def test_int4_zeros_take_up_the_mean_error_of_the_bfloat16_scales():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (128, 256), generator=g)
    codes[:, :32] = torch.randint(9, 16, (128, 32), generator=g)  # groups whose mean code is far from 8
    scales = torch.rand(128, 8, generator=g) * 0.01 + 1e-3  # float32, not bfloat16-representable
    zeros = torch.zeros(128, 8)  # exact in bfloat16: what is left is the scales' rounding alone
    exact = ((codes.reshape(128, 8, 32) - 8) * scales[..., None] + zeros[..., None]).reshape(128, 256)

    def group_mean_error(storage_zeros: torch.Tensor) -> torch.Tensor:
        kept = ((codes.reshape(128, 8, 32) - 8) * scales.to(torch.bfloat16).float()[..., None]).reshape(
            128, 256
        )
        err = kept + storage_zeros.repeat_interleave(32, dim=1) - exact
        return err.reshape(128, 8, 32).mean(-1).abs()

    _, absorbed = Int4GroupWeight(codes, scales, zeros).group_scales()
    naive = zeros.to(torch.bfloat16).float()  # each scale and zero rounded on its own
    assert group_mean_error(absorbed).mean() < 0.05 * group_mean_error(naive).mean()
    dequantized = Int4GroupWeight(codes, scales, zeros).dequantize(torch.float32)
    naive_weights = Int4GroupWeight(codes, scales.to(torch.bfloat16).float(), naive).dequantize(torch.float32)
    assert relative_error(dequantized, exact) < relative_error(naive_weights, exact)


@pytest.mark.parametrize("onednn", [True, False])
def test_float32_weights_in_either_layout_multiply_as_f_linear_and_count_once(monkeypatch, onednn):
    from engine.kernels import weights
    from engine.quant.base import model_weight_bytes

    if onednn and not weights.onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(weights, "onednn_linear_available", lambda: onednn)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    storage = DenseWeight(w)
    assert storage.layout == ("onednn" if onednn else "columns")
    assert torch.equal(storage.weight, w) and torch.equal(storage.rows(torch.tensor([5, 1])), w[[5, 1]])
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64)
        assert relative_error(storage.matmul("dense-fp32", x), torch.nn.functional.linear(x, w)) < 1e-6
    layer = KernelLinear(storage, None, KernelPolicy())
    assert model_weight_bytes(torch.nn.Sequential(layer, layer)) == w.numel() * 4  # one tensor, once


def test_q8_rows_are_exactly_the_blocks_values():
    storage = storages()["q8_0"]
    ids = torch.tensor([5, 0, 191, 5])
    codes = storage.block_codes[:, ids].float()  # [G, T, 32]
    want = (codes * storage.block_scales[:, ids].float()[..., None]).permute(1, 0, 2).reshape(4, -1)
    assert torch.equal(storage.rows(ids), want)


def test_fused_projections_equal_the_separate_layers_and_keep_nothing_alive():
    model = make_tiny_llama(vocab_size=300, seed=4)
    fused = copy.deepcopy(model)
    groups = fuse_projections(fused, KernelPolicy())
    assert groups == 4  # 2 layers x (q/k/v, gate/up)
    ids = torch.tensor([list(range(10, 40))])
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    attn = fused.model.layers[0].self_attn
    assert attn.qkv_proj._parts == () and attn.qkv_proj._input is None  # dropped after the slices
    assert all(isinstance(m, KernelLinear) for m in (attn.o_proj, fused.lm_head))
    assert fused.lm_head.storage.weight.data_ptr() == fused.model.embed_tokens.weight.data_ptr()  # tied


def forced_policy(storage, by_rows: dict[int, str]) -> KernelPolicy:
    """A policy whose table is given (no measuring): `by_rows` maps a bucket to its kernel."""
    table = {b: by_rows.get(b, by_rows[max(k for k in by_rows if k <= b)]) for b in ROW_BUCKETS}
    return KernelPolicy({table_key(storage): table})


def test_each_sequence_takes_the_kernel_of_its_own_row_count():
    storage = storages()["int4-g32"]
    policy = forced_policy(storage, {1: "packed", 2: "dense-bf16"})
    layer = KernelLinear(storage, None, policy)
    g = torch.Generator().manual_seed(2)
    decode_a, decode_b = torch.randn(1, 96, generator=g), torch.randn(1, 96, generator=g)
    prefill = torch.randn(5, 96, generator=g)
    with policy.step([1, 1, 5]) as record:
        together = layer(torch.cat([decode_a, decode_b, prefill]))
    assert policy.plan(storage, 7) == [(0, 7, "dense-bf16")]  # outside a step: by total rows
    assert record.uses == {"int4-g32/packed": 1, "int4-g32/dense-bf16": 1}
    with policy.step([1]):
        alone_a = layer(decode_a)
    with policy.step([5]):
        alone_prefill = layer(prefill)
    # bit for bit: a row's result does not depend on what else shared the step
    assert torch.equal(together[0], alone_a[0])
    assert torch.equal(together[2:], alone_prefill)


def test_a_recomputed_chunk_across_the_prompts_end_takes_both_kernels():
    """A sequence recomputed after preemption runs its prompt and its reply in one chunk: the
    prompt's rows the kernels of its length, the reply's the one-row kernels they were decoded
    with, so the K/V it writes again are the bits it wrote the first time."""
    seq = Sequence(1, list(range(12)), 7, SamplingParams())  # a 7-token prompt, 5 decoded
    assert _kernel_segments(seq, 12) == [(7, 7), (5, 1)]
    seq.num_computed_tokens = 4
    assert _kernel_segments(seq, 3) == [(3, 7)]  # a chunk inside the prompt
    seq.num_computed_tokens = 8
    assert _kernel_segments(seq, 4) == [(4, 1)]  # after it


def test_the_kernels_at_a_row_count_name_every_formats_choice():
    storage = storages()["int4-g32"]
    policy = forced_policy(storage, {1: "packed", 64: "dense-bf16"})
    assert policy.kernels_at(1) == policy.kernels_at(32) == b"int4-g32=packed"
    assert policy.kernels_at(33) == policy.kernels_at(5000) == b"int4-g32=dense-bf16"  # buckets 64, 512
    assert KernelPolicy().kernels_at(1) == b""  # one kernel everywhere: nothing to tell apart


def test_the_table_is_measured_once_and_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(policy_module, "_MEASURED", {})
    monkeypatch.setattr(policy_module, "ROW_BUCKETS", (1, 8))
    monkeypatch.setattr(policy_module, "PROBE_BYTES", 1)
    monkeypatch.setattr(policy_module, "QUIET_CPU_SHARE", 0.0)  # kept however busy this machine is
    timed = []
    original = policy_module._time_kernels
    monkeypatch.setattr(policy_module, "_time_kernels", lambda s, **kw: timed.append(s) or original(s, **kw))
    storage = storages(64, 64)["int8-row"]
    first = policy_module.measure(storage)
    assert set(first) == {1, 8} and set(first.values()) <= set(storage.kernels())
    monkeypatch.setattr(policy_module, "_MEASURED", {})  # a new process: the file answers
    assert policy_module.measure(storage) == first and len(timed) == 1
    assert list((tmp_path / "kernels").glob("*.json"))
