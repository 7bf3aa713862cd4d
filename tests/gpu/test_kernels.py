"""The GPU kernels at the real models' shapes (V2-Lite; V3's 128 heads), on the GPU:
what tests/kernels checks in Triton's interpreter at small shapes, checked here where
the kernels compile for the chip and tile sizes meet real dimensions."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def random_weight(gen: torch.Generator, quant: str, *shape: int):
    """A weight of `shape` as `quant` stores it: bf16, or e4m3 with 128x128 block scales or one scale."""
    from preload.kernels.fp8 import quantize_block
    from preload.kernels.quant import Fp8Weight

    w = torch.randn(*shape, device="cuda", generator=gen) * 0.02
    if quant == "none":
        return w.to(torch.bfloat16)
    block = (128, 128) if quant == "fp8_block" else tuple(shape)
    return Fp8Weight(*quantize_block(w, block), block)


@pytest.mark.parametrize("quant", ["none", "fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("shape", [(64, 6, 2048, 1408), (16, 8, 7168, 2048)], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("tokens", [1, 64, 512, 2048])
def test_fused_moe_at_real_shapes(quant, shape, tokens):
    """(2048 tokens of V2-Lite, 512 and more of V3's 16 experts here: moe_prefill.py's TMA kernels.)"""
    import torch.nn.functional as F

    from preload.kernels.fused_moe import block_rows, fp8_activations, fused_moe, stack_experts
    from preload.kernels.linear import dense
    from preload.kernels.moe import moe_experts, swiglu

    gen = torch.Generator(device="cuda").manual_seed(0)
    num, top_k, d, inner = shape

    def weight(*shape):
        return random_weight(gen, quant, *shape)

    experts = [(weight(inner, d), weight(inner, d), weight(d, inner)) for _ in range(num)]
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = torch.randn(tokens, num, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    stacked = tuple(stack_experts([e[i] for e in experts]) for i in range(3))
    if quant != "none" and fp8_activations(min(block_rows(tokens * top_k, num), 64)):
        # A prefill's e4m3 experts take e4m3 activations (x, and the product before down),
        # quantized per row and 128 columns: so does the reference.
        def expert(v, e):
            g, u, dn = (dense(w, torch.float32) for w in e)
            h = F.silu(e4m3(v).float() @ g.T) * (e4m3(v).float() @ u.T)
            return (e4m3(h.to(torch.bfloat16)).float() @ dn.T).to(torch.bfloat16)
    else:
        def expert(v, e):
            return swiglu(v, *e)
    want = moe_experts(x, ids, weights, [lambda v, e=e: expert(v, e) for e in experts]).float()
    got = fused_moe(x, ids, weights, *stacked).float()
    err = (got - want).abs().max() / want.abs().max()
    assert err < (2e-2 if quant == "none" else 3e-2), err  # (e4m3: V3's 7168-long rows, 2.04% seen)


@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_fused_moe_in_float32_through_a_prefills_blocks(tokens):
    """A float32 model (`--dtype float32` on a GPU: the GPU tests' daemons) at the block
    sizes a prompt step takes, 2048 tokens over 8 experts being 512 pairs each: the TMA
    kernels' tiles, sized for 2-byte operands, are not for it (moe_prefill.supported), and
    whatever runs must fit the chip and give the experts' sum."""
    from preload.kernels.fused_moe import fused_moe, stack_experts
    from preload.kernels.moe import moe_experts, swiglu

    gen = torch.Generator(device="cuda").manual_seed(3)
    num, top_k, d, inner = 8, 2, 128, 128
    experts = [tuple(torch.randn(*s, device="cuda", generator=gen) * 0.05 for s in ((inner, d), (inner, d), (d, inner)))
               for _ in range(num)]
    x = torch.randn(tokens, d, device="cuda", generator=gen)
    weights, ids = torch.randn(tokens, num, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    want = moe_experts(x, ids, weights, [lambda v, e=e: swiglu(v, *e) for e in experts])
    got = fused_moe(x, ids, weights, *(stack_experts([e[i] for e in experts]) for i in range(3)))
    assert got.dtype == torch.float32 and (got - want).abs().max() / want.abs().max() < 1e-2  # (tf32 products)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded as fp8_act.quantize_groups stores it (e4m3, a scale per row and group), back in x's dtype."""
    from preload.kernels.fp8_act import GROUP, quantize_groups

    q, scales = quantize_groups(x.contiguous())
    return (q.float().unflatten(-1, (-1, GROUP)) * scales[..., None]).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("quant", ["none", "fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("shape", [(64, 6, 2048, 1408, 2816), (16, 8, 7168, 2048, 2048)], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("tokens", ["one", "most"])
def test_decode_moe_at_real_shapes_and_in_a_graph(quant, shape, tokens):
    """V3's matrices with 16 of its 256 experts; one token, and as many as the path takes
    (MAX_TOKENS). A replayed CUDA graph gives the eager launch's output bit for bit (the
    slices are summed in a fixed order)."""
    from preload.kernels.fused_moe import stack_experts
    from preload.kernels.moe import moe_experts, swiglu
    from preload.kernels.moe_decode import MAX_TOKENS, fits, moe_decode

    tokens = 1 if tokens == "one" else MAX_TOKENS[quant != "none"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    num, top_k, d, inner, inner_shared = shape

    def weight(*shape):
        return random_weight(gen, quant, *shape)

    experts = [(weight(inner, d), weight(inner, d), weight(d, inner)) for _ in range(num)]
    shared = (weight(inner_shared, d), weight(inner_shared, d), weight(d, inner_shared))
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = torch.randn(tokens, num, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    stacked = tuple(stack_experts([e[i] for e in experts]) for i in range(3))
    want = (moe_experts(x, ids, weights, [lambda v, e=e: swiglu(v, *e) for e in experts]) + swiglu(x, *shared)).float()
    assert fits(tokens, *stacked, shared)
    eager = moe_decode(x, ids, weights, *stacked, shared)
    err = (eager.float() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_decode(x, ids, weights, *stacked, shared)
    replayed.fill_(float("nan"))
    graph.replay()
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("batch", [1, 16, 100, 256])
def test_absorbed_products_at_real_shapes(heads, batch):
    """q_nope W_uk and latent W_uv (dn = dv = 128, rank 512) through head_matvec: one tile of
    rows up to 16, tiles of 64 past it (workload B's 100, the largest decode graphs' 256)."""
    from preload.kernels.attention import absorbed_weights, per_head

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_b = (torch.randn(heads * 256, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    w_uk, w_uv = absorbed_weights(kv_b, heads, 128)
    q_nope = torch.randn(batch, heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
    latent = torch.randn(batch, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    for got, want in ((per_head(q_nope, w_uk.transpose(1, 2)), torch.einsum("bhd,hdr->bhr", q_nope.float(), w_uk.float())),
                      (per_head(latent, w_uv), torch.einsum("bhr,hvr->bhv", latent.float(), w_uv.float()))):
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 1e-2, err


@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lens", [[1, 1000, 8192], [4096] * 32, [1, 17, 63, 64, 65, 2000] * 6],
                         ids=["few", "batch 32", "mixed 36"])  # (from batch 4: 32 tokens a step)
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


@pytest.mark.parametrize("rows", [1, 100, 2048])
def test_swiglu_of_gate_and_up_side_by_side_equals_them_apart(rows):
    """Gate and up lying side by side (the arena's layout) take one product on a GPU: the
    output of two products of the matrices apart, within bf16's rounding (V2-Lite's shared
    experts' shapes)."""
    from preload.kernels.moe import side_by_side, swiglu

    gen = torch.Generator(device="cuda").manual_seed(0)
    d, inner = 2048, 2816
    buffer = (torch.randn(3 * inner * d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    gate, up, down = buffer[: inner * d].view(inner, d), buffer[inner * d : 2 * inner * d].view(inner, d), \
        buffer[2 * inner * d :].view(d, inner)
    assert side_by_side(gate, up) is not None and side_by_side(gate.clone(), up.clone()) is None
    x = torch.randn(rows, d, device="cuda", generator=gen).to(torch.bfloat16)
    got, want = swiglu(x, gate, up, down).float(), swiglu(x, gate.clone(), up.clone(), down).float()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
