"""The decode MoE kernels (Triton, two launches) give what the expert loop plus the shared
MLP give, for bf16, fp8_block and fp8_per_tensor weights, one or two tokens, with or
without shared experts, however K is sliced; every buffer they write starts poisoned, so
an element left unwritten shows. On a machine without a GPU they run in Triton's
interpreter, on the GPU for real (and `-m gpu` at V2-Lite's and V3's shapes)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, experts  # noqa: E402

from preload.kernels.fused_moe import stack_experts  # noqa: E402
from preload.kernels.linear import dense  # noqa: E402
from preload.kernels.moe import moe_experts, swiglu  # noqa: E402
from preload.kernels.moe_decode import MAX_TOKENS, fits, moe_decode  # noqa: E402


def case(quant: str, tokens: int, shared: bool, seed: int = 0):
    """A layer of 8 experts, top 3, D 256 (two K tiles) and I 200 (edges in every tile and
    block), the shared experts 320 wide; x, the routing, and the float32 reference."""
    gen = torch.Generator().manual_seed(seed)
    num, top_k, d, inner = 8, 3, 256, 200
    ws = experts(num, d, inner, quant, gen)
    common = experts(1, d, 320, quant, gen)[0] if shared else None
    x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    weights, ids = torch.randn(tokens, num, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    stacked = tuple(stack_experts([e[i] for e in ws]) for i in range(3))
    as_float = [tuple(dense(m, torch.float32).float() for m in e) for e in ws]
    want = moe_experts(x.float(), ids, weights, [lambda v, e=e: swiglu(v, *e) for e in as_float])
    if common is not None:
        want = want + swiglu(x.float(), *(dense(m, torch.float32).float() for m in common))
    return x, ids, weights, stacked, common, want


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty of the test filled with NaN (the kernels' outputs and partial sums)."""
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_filled)


@pytest.mark.parametrize("quant, tokens, shared", [("none", 1, True), ("fp8_block", 2, True), ("fp8_block", 1, False),
                                                   ("fp8_per_tensor", 4, True)])
def test_decode_moe_equals_the_expert_loop_plus_the_shared_mlp(poisoned, quant, tokens, shared):
    x, ids, weights, stacked, common, want = case(quant, tokens, shared)
    assert fits(tokens, *stacked, common)
    got = moe_decode(x, ids, weights, *stacked, common)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert not got.isnan().any()
    assert torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2), (got.float() - want).abs().max()


@pytest.mark.parametrize("splits", [1, 3])
def test_every_slicing_of_k_gives_the_same_sums_launch_after_launch(splits):
    """Slices meet through arrival counters that reset themselves: the same output each
    launch, whatever the number of slices (each a different order of float32 sums, so
    close to each other, not equal)."""
    x, ids, weights, stacked, common, want = case("fp8_block", 2, True, seed=1)
    first = moe_decode(x, ids, weights, *stacked, common, config={"splits": splits})
    assert torch.equal(moe_decode(x, ids, weights, *stacked, common, config={"splits": splits}), first)
    assert torch.allclose(first.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_weights_in_forms_one_set_of_strides_cannot_read_do_not_fit():
    _, _, _, (gate, up, down), _, _ = case("fp8_block", 1, False)
    _, _, _, bf16, bf16_shared, _ = case("none", 1, True)
    assert fits(1, gate, up, down, None)
    assert not fits(1, gate, up, down, bf16_shared), "fp8 routed experts, bf16 shared ones"
    assert not fits(1, gate, type(up)(up.q, up.scale_inv, (64, 128)), down, None), "two scale blocks"
    column_major = up.q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not fits(1, gate, type(up)(column_major, up.scale_inv, up.block), down, None), "K not contiguous"


def test_past_a_few_tokens_the_grouped_gemms_take_the_layer():
    _, _, _, fp8, _, _ = case("fp8_block", 1, False)
    _, _, _, bf16, _, _ = case("none", 1, False)
    assert fits(MAX_TOKENS[True], *fp8, None) and not fits(MAX_TOKENS[True] + 1, *fp8, None)
    assert fits(MAX_TOKENS[False], *bf16, None) and not fits(MAX_TOKENS[False] + 1, *bf16, None)
