"""The fused MoE kernels (Triton) give what the reference expert loop gives, for bf16,
fp8_block and fp8_per_tensor weights read in place from strided views; every output row
a kernel owns is written. On a machine without a GPU they run in Triton's interpreter
(tests/conftest.py), on the GPU for real (the same tests, and `-m gpu` at V2-Lite's shapes)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, experts  # noqa: E402

from preload.kernels.fused_moe import _launch, align_by_expert, fused_moe, stack_experts  # noqa: E402
from preload.kernels.linear import dense  # noqa: E402
from preload.kernels.moe import moe_experts, swiglu  # noqa: E402


@pytest.mark.parametrize("quant", ["none", "fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_fused_moe_equals_the_expert_loop(quant, tokens):
    gen = torch.Generator().manual_seed(0)
    num, top_k, d, inner = 8, 3, 128, 192
    ws = experts(num, d, inner, quant, gen)
    x = (torch.randn(tokens, d, generator=gen)).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(tokens, num, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    stacked = tuple(stack_experts([e[i] for e in ws]) for i in range(3))
    in_float = [tuple(dense(m, torch.float32).float() for m in e) for e in ws]  # the reference: dequantized, fp32
    want = moe_experts(x.float(), ids, weights, [lambda v, e=e: swiglu(v, *e) for e in in_float])
    got = fused_moe(x, ids, weights, *stacked)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), (got.float() - want).abs().max()


def test_stacking_evenly_spaced_experts_is_a_view_and_other_experts_are_copied():
    buffer = torch.arange(4 * 3 * 6, dtype=torch.float32).view(4, 3, 6)
    views = [buffer[e, 1:] for e in range(4)]  # [2, 6] each, one stride apart
    stacked = stack_experts(views)
    assert stacked.data_ptr() == views[0].data_ptr() and torch.equal(stacked, buffer[:, 1:])
    apart = [torch.randn(2, 6) for _ in range(4)]
    assert torch.equal(stack_experts(apart), torch.stack(apart))


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_groups_every_pair_by_expert_in_padded_blocks(block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], device=DEVICE)
    sorted_pairs, block_expert, padded_rows = align_by_expert(ids, 8, block_m)
    pairs = ids.numel()
    used = sorted_pairs[: int(padded_rows)].tolist()
    assert sorted(p for p in used if p < pairs) == list(range(pairs)), "every pair once"
    for b in range(int(padded_rows) // block_m):
        block = [p for p in used[b * block_m : (b + 1) * block_m] if p < pairs]
        assert block and all(ids.flatten()[p] == block_expert[b] for p in block), "one expert per block"
    assert (sorted_pairs[int(padded_rows):] == pairs).all()


def test_every_row_a_kernel_owns_is_written():
    gen = torch.Generator().manual_seed(1)
    ws = experts(4, 128, 128, "none", gen)
    gate, up, _ = (stack_experts([e[i] for e in ws]) for i in range(3))
    ids = torch.tensor([[0, 2], [2, 3], [1, 2]], device=DEVICE)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    aligned = align_by_expert(ids, 4, 16)
    h = torch.full((6, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    _launch(x, gate, h, aligned, 6, 2, 16, w2=up)
    assert not h.isnan().any()


def test_separate_allocations_are_copied_even_when_they_lie_evenly_apart():
    buffer = torch.zeros(4, 16)
    apart = [buffer[i].clone() for i in range(4)]  # each its own storage, wherever the allocator put it
    stacked = stack_experts(apart)
    assert stacked.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in apart}
    assert torch.equal(stacked, torch.stack(apart))
