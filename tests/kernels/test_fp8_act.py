"""Activations in e4m3 (Triton, fp8_act.py): the same values and scales as the torch
reference, bit for bit; and the GEMMs that take them (a prefill's experts and fp8 dense
rows) give what dequantized activations through the dequantized weights give, within
float32 rounding, and the float computation within e4m3's. Without a GPU they run in
Triton's interpreter (tests/conftest.py); `-m gpu` runs them at V2-Lite's and V3's shapes."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, experts  # noqa: E402

from preload.kernels.fp8 import dequantize_block, quantize_block  # noqa: E402
from preload.kernels.fp8_act import GROUP, quantize_groups  # noqa: E402
from preload.kernels.fp8_linear import block_scaled_gemm, block_scaled_linear, fp8_linear, takes_block_scales  # noqa: E402
from preload.kernels.fused_moe import block_rows, fp8_activations, fused_moe, stack_experts  # noqa: E402
from preload.kernels.linear import dense  # noqa: E402
from preload.kernels.moe import moe_experts, swiglu  # noqa: E402
from preload.kernels.quant import Fp8Weight  # noqa: E402


def through_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it once quantized per row and GROUP columns (the reference), in float32."""
    q, scale = quantize_block(x.float(), (1, GROUP))
    return dequantize_block(q, scale, (1, GROUP), torch.float32)


@pytest.mark.parametrize("shape", [(37, 300), (16, 128), (1, 2048), (40, 64)])
def test_values_and_scales_are_the_references_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None]  # rows of every size
    x[0] = 0  # an all-zero row: the smallest scale, zeros
    x = x.to(torch.bfloat16).to(DEVICE)
    q, scale = quantize_groups(x)
    want_q, want_scale = quantize_block(x.float(), (1, GROUP))
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape and scale.shape == (shape[0], -(-shape[1] // GROUP))
    assert torch.equal(q.view(torch.uint8), want_q.to(DEVICE).view(torch.uint8))
    assert torch.equal(scale, want_scale.to(DEVICE))


def test_scales_by_column_are_the_same_scales_stored_as_cublaslt_reads_them():
    x = (torch.randn(37, 300, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16).to(DEVICE)
    q, scale = quantize_groups(x)
    q_col, scale_col = quantize_groups(x, scales_by_column=True)
    assert scale_col.shape == scale.shape and scale_col.stride() == (1, 37)
    assert torch.equal(scale_col, scale) and torch.equal(q_col.view(torch.uint8), q.view(torch.uint8))


def moe_case(tokens: int, num: int, top_k: int, d: int, inner: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ws = experts(num, d, inner, "fp8_block", gen)
    x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    weights, ids = torch.randn(tokens, num, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return ws, x, weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("tokens, num, top_k", [(100, 8, 3), (256, 4, 2)])
def test_a_prefills_experts_take_e4m3_activations_and_give_what_the_reference_does(tokens, num, top_k):
    d, inner = 256, 256  # (two scale groups each way)
    ws, x, weights, ids = moe_case(tokens, num, top_k, d, inner)
    assert block_rows(tokens * top_k, num) >= 64 and fp8_activations(64)
    stacked = tuple(stack_experts([e[i] for e in ws]) for i in range(3))
    got = fused_moe(x, ids, weights, *stacked).float()
    in_float = [tuple(dense(m, torch.float32).float() for m in e) for e in ws]

    def e4m3_expert(v, e):
        gate, up, down = in_float[e]
        return through_e4m3(torch.nn.functional.silu(v @ gate.T) * (v @ up.T)) @ down.T

    mirrored = moe_experts(through_e4m3(x), ids, weights, [lambda v, e=e: e4m3_expert(v, e) for e in range(num)])
    scale = mirrored.abs().max().item()
    # (an h on an e4m3 rounding boundary may go either way when its sum is ordered otherwise:
    # one step is an eighth to a sixteenth of it)
    assert torch.allclose(got, mirrored, atol=2e-2 * scale, rtol=2e-2), (got - mirrored).abs().max() / scale
    exact = moe_experts(x.float(), ids, weights, [lambda v, e=e: swiglu(v, *e) for e in in_float])
    assert torch.allclose(got, exact, atol=6e-2 * scale, rtol=6e-2), (got - exact).abs().max() / scale


@pytest.mark.parametrize("block", [(128, 128), None], ids=["fp8_block", "fp8_per_tensor"])
def test_many_dense_rows_take_e4m3_activations(block):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 384, generator=gen) * 0.05
    q, scale = quantize_block(w, block or w.shape)
    weight = Fp8Weight(q.to(DEVICE), scale.to(DEVICE), block or w.shape)
    x = torch.randn(300, 384, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = fp8_linear(x, weight).float()
    mirrored = through_e4m3(x) @ weight.dequantize(torch.float32).T
    top = mirrored.abs().max().item()
    assert torch.allclose(got, mirrored, atol=1e-2 * top, rtol=1e-2), (got - mirrored).abs().max() / top


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["v2-lite", "v3"])
def test_experts_at_real_shapes_with_e4m3_activations(shape):
    """V2-Lite (64 experts, top 6, 2048 x 1408) at 2048 tokens, blocks of 128 rows; V3
    (256 experts, top 8, 7168 x 2048) at 1024 tokens, blocks of 64."""
    num, top_k, d, inner, tokens = (64, 6, 2048, 1408, 2048) if shape == "v2-lite" else (256, 8, 7168, 2048, 1024)
    ws, x, weights, ids = moe_case(tokens, num, top_k, d, inner, seed=1)
    stacked = tuple(stack_experts([e[i] for e in ws]) for i in range(3))
    got = fused_moe(x, ids, weights, *stacked).float()
    in_float = [tuple(dense(m, torch.float32).float() for m in e) for e in ws]
    exact = moe_experts(x.float(), ids, weights, [lambda v, e=e: swiglu(v, *e) for e in in_float])
    # Each e4m3 rounding errs by up to 1/16 of a value (3 mantissa bits), about 2.7% RMS;
    # x and h are each rounded once, independently.
    err = (got - exact).norm() / exact.norm()
    assert err < 5e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 301])
@pytest.mark.parametrize("n, k", [(3072, 2048), (576, 2048), (4096, 512), (2048, 2816), (24576, 1536), (7168, 2048)])
def test_a_prefills_dense_rows_through_cublaslt_give_what_the_reference_does(n, k, rows):
    """V2-Lite's and V3's dense matrices (2816: K blocks not a multiple of 4, whose scales
    torch takes padded) at a prefill's rows, where fp8_linear takes cuBLASLt's block-scaled
    GEMM (on Hopper): the e4m3 rows through the dequantized weights, within float32
    rounding, as the Triton path gives."""
    if not block_scaled_gemm(torch.device(DEVICE)):
        pytest.skip("cuBLASLt's block-scaled fp8 GEMM needs Hopper and torch >= 2.10")
    gen = torch.Generator().manual_seed(n + k)
    q, scale = quantize_block(torch.randn(n, k, generator=gen) * 0.05)
    weight = Fp8Weight(q.to(DEVICE), scale.to(DEVICE), (128, 128))
    assert takes_block_scales(weight)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = fp8_linear(x, weight).float()
    assert torch.equal(got, block_scaled_linear(x, weight).float())  # (the path taken)
    mirrored = through_e4m3(x) @ weight.dequantize(torch.float32).T
    top = mirrored.abs().max().item()
    assert torch.allclose(got, mirrored, atol=1e-2 * top, rtol=1e-2), (got - mirrored).abs().max() / top


def test_a_shape_cublaslt_refuses_takes_the_triton_gemm_for_good(monkeypatch, caplog):
    """cuBLASLt may refuse a shape on one GPU that it runs on another (NOT_SUPPORTED, from
    its heuristics): fp8_linear then gives the Triton path's result, asks no more for that
    shape, and says so once; any other error is not swallowed."""
    import preload.kernels.fp8_linear as fl

    gen = torch.Generator().manual_seed(3)
    q, scale = quantize_block(torch.randn(256, 256, generator=gen) * 0.05)
    weight = Fp8Weight(q.to(DEVICE), scale.to(DEVICE), (128, 128))
    x = torch.randn(301, 256, generator=gen).to(torch.bfloat16).to(DEVICE)  # a prefill's rows: e4m3 activations
    want = fp8_linear(x, weight)  # (the Triton path: no cuBLASLt here)
    tried = []

    def refuse(rows, w):
        tried.append(rows.shape[0])
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul(...)`")

    monkeypatch.setattr(fl, "block_scaled_gemm", lambda device: True)
    monkeypatch.setattr(fl, "block_scaled_linear", refuse)
    monkeypatch.setattr(fl, "REFUSED", set())
    assert takes_block_scales(weight)
    assert torch.equal(fp8_linear(x, weight), want) and torch.equal(fp8_linear(x, weight), want)
    assert tried == [301] and fl.REFUSED == {(304, 256, 256)}
    assert sum("refused 304 rows" in r.getMessage() for r in caplog.records) == 1

    def fail(rows, w):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(fl, "block_scaled_linear", fail)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fp8_linear(torch.cat([x, x[:30]]), weight)  # (331 rows: another shape)
