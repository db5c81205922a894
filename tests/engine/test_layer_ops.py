"""kvk's layer ops (engine/kernels/native/layer_ops.c), which the own forward of a model on kvk
runs in place of torch's: the residual add with the RMSNorm after it, and RoPE in place."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import native
from engine.model.llama_forward import _Rope, _rotate

kvk = native.kernels()
pytestmark = pytest.mark.skipif(kvk is None, reason=f"kvk: {native.status()}")


@pytest.mark.parametrize("n", [576, 2048, 37])
def test_the_add_and_norm_are_torchs_within_float32_rounding(n):
    g = torch.Generator().manual_seed(n)
    x, res = torch.randn(5, n, generator=g) * 3, torch.randn(5, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    want_x = x + res
    want_h = torch.rms_norm(want_x, (n,), w, 1e-5)
    got_x, got_h = kvk.add_rms_norm(x.clone(), w, 1e-5, res)
    assert torch.equal(got_x, want_x)  # an add rounds once, as torch's
    torch.testing.assert_close(got_h, want_h, rtol=2e-6, atol=1e-6)
    alone_x, alone_h = kvk.add_rms_norm(x, w, 1e-5)  # no residual: the norm of x itself
    assert alone_x is x
    torch.testing.assert_close(alone_h, torch.rms_norm(x, (n,), w, 1e-5), rtol=2e-6, atol=1e-6)


def test_the_sum_is_written_into_the_residual_stream_and_each_row_alone():
    x, res, w = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64)
    stream = x.clone()
    out, h = kvk.add_rms_norm(stream, w, 1e-6, res)
    assert out.data_ptr() == stream.data_ptr() and torch.equal(stream, x + res)
    _, first = kvk.add_rms_norm(x[:1].clone(), w, 1e-6, res[:1])
    assert torch.equal(first, h[:1])


@pytest.mark.parametrize("width", [64, 32])  # whole heads, and Phi-3's partial rotary
def test_rope_is_the_own_forwards_rotation(width):
    g = torch.Generator().manual_seed(width)
    tokens, heads, d = 3, 6, 64
    qk = torch.randn(tokens, 2, heads, d, generator=g)[:, 0]  # a strided view, as the fused qkv's
    angles = torch.rand(tokens, 1, width // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)  # the first half negated, as _rope_table makes it
    rope = _Rope(cos, sin, width // 2, width)
    want = qk.clone()
    _rotate(want, rope, d)
    kvk.rope_(qk, *rope.rows())
    torch.testing.assert_close(qk, want, rtol=0, atol=1e-6)  # torch's addcmul may fuse its multiply-add


def test_shapes_the_ops_cannot_take_are_refused():
    with pytest.raises(ValueError):
        kvk.add_rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError):
        kvk.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError):
        kvk.rope_(torch.randn(2, 3, 8), torch.ones(2, 16), torch.ones(2, 16))


@pytest.mark.parametrize("inter", [1536, 37])
def test_the_silu_gate_is_torchs_within_float32_rounding_and_each_row_alone(inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(3, 2 * inter, generator=g) * 6  # large |gate| too: e^-|g| never overflows
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    got = kvk.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=1e-30)
    assert torch.equal(kvk.silu_mul(gate_up[1:2].clone()), got[1:2])


def test_greedy_sampling_s_argmax_and_log_sum_exp():
    g = torch.Generator().manual_seed(3)
    for n in (49152, 37):
        scores = torch.randn(n, generator=g) * 4
        scores[n // 3] = scores[n // 2] = scores.max() + 1  # a tie: the first is the argmax
        scores[5] = -float("inf")  # a masked token
        index, lse = kvk.argmax_logsumexp(scores)
        assert index == int(scores.argmax()) == n // 3
        assert lse == pytest.approx(float(scores.double().logsumexp(0)), rel=1e-6)
    scores[7] = float("nan")
    assert kvk.argmax_logsumexp(scores) is None  # the sampler then raises its NaN message
