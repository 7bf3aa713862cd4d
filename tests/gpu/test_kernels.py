"""The GPU kernels at the real models' shapes (V2-Lite; V3's 128 heads), on the GPU:
what tests/kernels checks in Triton's interpreter at small shapes, checked here where
the kernels compile for the chip and tile sizes meet real dimensions."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", ["none", "fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fused_moe_at_v2_lite_shapes(quant, tokens):
    from preload.kernels.fp8 import quantize_block
    from preload.kernels.fused_moe import fused_moe, stack_experts
    from preload.kernels.moe import moe_experts, swiglu
    from preload.kernels.quant import Fp8Weight

    gen = torch.Generator(device="cuda").manual_seed(0)
    num, top_k, d, inner = 64, 6, 2048, 1408

    def weight(*shape):
        w = torch.randn(*shape, device="cuda", generator=gen) * 0.02
        if quant == "none":
            return w.to(torch.bfloat16)
        block = (128, 128) if quant == "fp8_block" else tuple(shape)
        return Fp8Weight(*quantize_block(w, block), block)

    experts = [(weight(inner, d), weight(inner, d), weight(d, inner)) for _ in range(num)]
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = torch.randn(tokens, num, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    stacked = tuple(stack_experts([e[i] for e in experts]) for i in range(3))
    want = moe_experts(x, ids, weights, [lambda v, e=e: swiglu(v, *e) for e in experts]).float()
    got = fused_moe(x, ids, weights, *stacked).float()
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lens", [[1, 1000, 8192], [4096] * 32])
def test_mla_decode_at_real_shapes(heads, fp8, lens):
    from kernel_cases import as_float, paged_case

    from preload.kernels.attention import mla_decode_reference
    from preload.kernels.mla_decode import mla_decode_latent

    q_lat, q_pe, pools, table, ctx = paged_case(lens, heads, 512, 64, 16, fp8)
    scale = 192**-0.5
    got = mla_decode_latent(q_lat, q_pe, pools, table, ctx, 16, max(lens), scale).float()
    want = mla_decode_reference(q_lat.float(), q_pe.float(), as_float(pools),
                                table, ctx, 16, max(lens), scale)
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
