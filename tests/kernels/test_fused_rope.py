"""The fused rotary embedding (Triton) gives what `rope_cos_sin` then `apply_rope` give,
for the queries' heads and the shared key in one launch, interleaved or not: in bf16
bit for bit when given the same cos and sin, and from positions up to the last bit of
cos and sin (computed by another implementation of cos and sin). Without a GPU it runs
in Triton's interpreter (tests/conftest.py); `-m gpu` adds the real models' shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE  # noqa: E402

from preload.kernels.fused_rope import fused_apply_rope, fused_rope, fused_rope_qk  # noqa: E402
from preload.kernels.rope import apply_rope, rope_cos_sin, rope_frequencies  # noqa: E402

YARN = SimpleNamespace(theta=10000.0, kind="yarn", factor=40.0, original_max_position_embeddings=4096,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)  # V3's, but mscale: scale != 1


def qk_case(tokens: int, heads: int, dtype, seed: int = 0, dr: int = 64, nope: int = 128, rank: int = 512):
    """q_pe and k_pe as the model has them: slices of the projections' outputs, whose
    other columns are NaN here so that reading outside the slice shows; positions up to
    160k (YaRN's long context)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.full((tokens, heads, nope + dr), float("nan"))
    q[..., nope:] = torch.randn(tokens, heads, dr, generator=gen) * 2
    kv = torch.full((tokens, rank + dr), float("nan"))
    kv[:, rank:] = torch.randn(tokens, dr, generator=gen) * 2
    positions = torch.randint(0, 160_000, (tokens,), generator=gen)
    q_pe, k_pe = q.to(dtype).to(DEVICE)[..., nope:], kv.to(dtype).to(DEVICE)[:, rank:]
    return q_pe, k_pe, positions.to(DEVICE)


def reference(q_pe, k_pe, positions, inv_freq, scale, interleaved):
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    return apply_rope(q_pe, cos[:, None], sin[:, None], interleaved), apply_rope(k_pe, cos, sin, interleaved)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """Within what a last-bit difference of cos or sin (in x's dtype) can move the result."""
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    bound = 4 * torch.finfo(x.dtype).eps * x.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("tokens, dtype", [(1, torch.bfloat16), (37, torch.bfloat16), (37, torch.float32)],
                         ids=["1-bf16", "37-bf16", "37-fp32"])
def test_queries_and_key_from_positions_equal_cos_sin_then_apply_rope(tokens, dtype, interleaved):
    q_pe, k_pe, positions = qk_case(tokens, 8, dtype)
    inv_freq, scale = rope_frequencies(YARN, 64)
    want_q, want_k = reference(q_pe, k_pe, positions, inv_freq, scale, interleaved)
    got_q, got_k = fused_rope_qk(q_pe, k_pe, positions, inv_freq.to(DEVICE), scale, interleaved)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_close_to(got_q, want_q, q_pe)
    assert_close_to(got_k, want_k, k_pe)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_given_cos_and_sin_the_result_is_apply_ropes(dtype, interleaved):
    """bf16: every product and sum rounded where torch rounds it, so bit for bit; float32
    may differ in the last bit where the GPU fuses a product into the sum."""
    q_pe, k_pe, positions = qk_case(9, 4, dtype, seed=1)
    cos, sin = rope_cos_sin(positions, *rope_frequencies(YARN, 64))
    want_q, want_k = apply_rope(q_pe, cos[:, None], sin[:, None], interleaved), apply_rope(k_pe, cos, sin, interleaved)
    got_q, got_k = fused_apply_rope(q_pe, cos, sin, interleaved, k=k_pe)
    if dtype == torch.bfloat16:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:
        assert torch.allclose(got_q, want_q, rtol=1e-6, atol=1e-6) and torch.allclose(got_k, want_k, rtol=1e-6, atol=1e-6)
    alone, none = fused_apply_rope(k_pe, cos, sin, interleaved)
    assert none is None and torch.equal(alone, got_k)


def test_one_tensor_alone_is_rotated_as_in_the_pair():
    q_pe, k_pe, positions = qk_case(5, 3, torch.bfloat16, seed=2)
    inv_freq, scale = rope_frequencies(YARN, 64)
    q, k = fused_rope_qk(q_pe, k_pe, positions, inv_freq, scale, False)
    assert torch.equal(fused_rope(q_pe, positions, inv_freq, scale, False), q)
    assert torch.equal(fused_rope(k_pe, positions, inv_freq, scale, False), k)


def test_heads_spread_over_several_programs_are_all_rotated():
    q_pe, k_pe, positions = qk_case(3, 37, torch.bfloat16, seed=5)  # 37 heads: blocks of 16, the last partial
    inv_freq, scale = rope_frequencies(YARN, 64)
    want_q, want_k = reference(q_pe, k_pe, positions, inv_freq, scale, True)
    got_q, got_k = fused_rope_qk(q_pe, k_pe, positions, inv_freq, scale, True)
    assert_close_to(got_q, want_q, q_pe)
    assert_close_to(got_k, want_k, k_pe)


def test_a_key_that_does_not_match_the_queries_is_refused():
    q_pe, k_pe, positions = qk_case(3, 2, torch.float32)
    inv_freq, scale = rope_frequencies(YARN, 64)
    with pytest.raises(ValueError):
        fused_rope_qk(q_pe, k_pe[:2], positions, inv_freq, scale, False)


@pytest.mark.gpu
def test_a_cuda_graph_replays_it_for_new_positions():
    q_pe, k_pe, positions = qk_case(8, 16, torch.bfloat16, seed=4)
    inv_freq, scale = rope_frequencies(YARN, 64)
    inv_freq = inv_freq.cuda()  # on the device already: nothing to copy while capturing
    fused_rope_qk(q_pe, k_pe, positions, inv_freq, scale, False)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_q, got_k = fused_rope_qk(q_pe, k_pe, positions, inv_freq, scale, False)
    positions.copy_(positions.flip(0) + 7)
    graph.replay()
    want_q, want_k = reference(q_pe, k_pe, positions, inv_freq, scale, False)
    assert_close_to(got_q, want_q, q_pe)
    assert_close_to(got_k, want_k, k_pe)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("tokens", [1, 256, 512])
@pytest.mark.parametrize("heads", [16, 128])  # V2-Lite, V3
def test_real_shapes_on_the_gpu(heads, tokens, interleaved):
    q_pe, k_pe, positions = qk_case(tokens, heads, torch.bfloat16, seed=3)
    inv_freq, scale = rope_frequencies(YARN, 64)
    want_q, want_k = reference(q_pe, k_pe, positions, inv_freq, scale, interleaved)
    got_q, got_k = fused_rope_qk(q_pe, k_pe, positions, inv_freq.cuda(), scale, interleaved)
    assert_close_to(got_q, want_q, q_pe)
    assert_close_to(got_k, want_k, k_pe)
