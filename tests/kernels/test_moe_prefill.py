"""A prefill's routed experts through TMA (kernels/moe_prefill.py) give what the
reference expert loop gives, bf16 and fp8_block, with experts read in place from the
arena's strided views; the rows gathered in expert order are the tokens' rows and zero
for padding. In Triton's interpreter without a GPU (tests/conftest.py); `-m gpu` runs
them on the GPU and at V2-Lite's shapes (tests/gpu/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, experts  # noqa: E402

from preload.kernels.fused_moe import stack_experts  # noqa: E402
from preload.kernels.linear import dense  # noqa: E402
from preload.kernels.moe import moe_experts, swiglu  # noqa: E402
from preload.kernels.moe_align import align_by_expert_triton  # noqa: E402
from preload.kernels.moe_prefill import gather_rows, moe_prefill, supported  # noqa: E402


def routed(tokens: int, num: int, top_k: int, gen: torch.Generator):
    logits = torch.randn(tokens, num, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_moe_prefill_equals_the_expert_loop(quant):
    gen = torch.Generator().manual_seed(0)
    num, top_k, d, inner, tokens, block_m = 4, 2, 256, 128, 40, 64
    ws = experts(num, d, inner, quant, gen)
    x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    weights, ids = routed(tokens, num, top_k, gen)
    gate, up, down = (stack_experts([e[i] for e in ws]) for i in range(3))
    assert supported(gate, up, down, block_m)
    in_float = [tuple(dense(m, torch.float32).float() for m in e) for e in ws]  # the reference: dequantized, fp32
    want = moe_experts(x.float(), ids, weights, [lambda v, e=e: swiglu(v, *e) for e in in_float])
    got = moe_prefill(x, ids, weights, gate, up, down, align_by_expert_triton(ids, num, block_m), block_m)
    assert got.shape == want.shape and got.dtype == x.dtype
    tol = 2e-2 if quant == "none" else 6e-2  # (fp8: the activations are e4m3 too)
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


def test_per_tensor_scales_small_blocks_unaligned_rows_and_float32_are_left_to_fused_moe():
    gen = torch.Generator().manual_seed(2)
    per_tensor = stack_experts([e[0] for e in experts(2, 128, 128, "fp8_per_tensor", gen)])
    bf16 = stack_experts([e[0] for e in experts(2, 128, 128, "none", gen)])
    odd = torch.zeros(2, 8, 130, dtype=torch.bfloat16, device=DEVICE)[:, :, :127]  # rows 260 bytes apart
    assert not supported(per_tensor, per_tensor, per_tensor, 64)
    assert not supported(bf16, bf16, bf16, 32) and supported(bf16, bf16, bf16, 128)
    assert not supported(bf16, bf16, odd, 128)
    f32 = bf16.float()  # (its tiles would not fit the shared memory the stages are sized for)
    assert not supported(f32, f32, f32, 128)


def test_gathered_rows_are_the_pairs_tokens_and_padding_is_zero():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], device=DEVICE)
    x = torch.arange(1, 4 * 8 + 1, dtype=torch.float32, device=DEVICE).view(4, 8)
    aligned = align_by_expert_triton(ids, 8, 4)
    sorted_pairs, _, padded_rows = aligned
    rows = gather_rows(x, aligned, ids.numel(), 2)[: int(padded_rows)]
    for r, pair in enumerate(sorted_pairs[: int(padded_rows)].tolist()):
        want = x[pair // 2] if pair < ids.numel() else torch.zeros(8, device=DEVICE)
        assert torch.equal(rows[r], want), r
