"""A token's k expert rows summed in one pass (kernels/moe_sum.py) give the reference's
`y.view(T, k, D).sum(1) + shared`, in float32 and rounded once, for any k, any number of
tokens and columns that do not fill a tile; and the MoE layer on the GPU path adds the
shared experts' output there. In Triton's interpreter without a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, experts  # noqa: E402

from preload.kernels.fused_moe import fused_moe, stack_experts  # noqa: E402
from preload.kernels.moe_sum import sum_pairs, sum_pairs_reference  # noqa: E402


@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("tokens, d", [(1, 64), (7, 300), (9, 1030)])
@pytest.mark.parametrize("shared", [False, True], ids=["routed-only", "plus-shared"])
def test_the_sum_of_a_tokens_rows_is_the_references(top_k, tokens, d, shared):
    gen = torch.Generator().manual_seed(top_k * 100 + tokens)
    y = torch.randn(tokens * top_k, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    add = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE) if shared else None
    want = y.float().view(tokens, top_k, d).sum(1) + (add.float() if shared else 0)
    got = sum_pairs(y, top_k, add)
    assert got.shape == (tokens, d) and got.dtype == torch.bfloat16
    # One bf16 rounding of the float32 sum: within an ulp (Triton's interpreter truncates).
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(sum_pairs_reference(y, top_k, add).float(), want, atol=0, rtol=2 ** -8)


def test_no_tokens_sum_to_nothing():
    assert sum_pairs(torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE), 6).shape == (0, 64)


def test_the_moe_adds_what_it_is_given_in_the_same_pass():
    gen = torch.Generator().manual_seed(5)
    num, top_k, d, inner, tokens = 8, 3, 128, 192, 9
    stacked = tuple(stack_experts([e[i] for e in experts(num, d, inner, "none", gen)]) for i in range(3))
    x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    weights, ids = torch.randn(tokens, num, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    shared = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    alone = fused_moe(x, ids, weights, *stacked)
    got = fused_moe(x, ids, weights, *stacked, add=shared)
    torch.testing.assert_close(got.float(), alone.float() + shared.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, alone)
