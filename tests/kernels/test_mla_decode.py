"""The MLA decode kernel (Triton) reads each sequence's context through its block table,
in any order of blocks, bf16 or e4m3 with per-row scales, split over long contexts, and
gives what gathering the context and attending does (`mla_decode_reference`). Without a
GPU it runs in Triton's interpreter (tests/conftest.py); `-m gpu` adds real shapes."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, as_float, paged_case  # noqa: E402

from preload.kernels.attention import mla_decode, mla_decode_reference  # noqa: E402
from preload.kernels.mla_decode import (  # noqa: E402
    MAX_SPLITS,
    MIN_SPLIT,
    block_n,
    launch_shapes,
    mla_decode_latent,
    splits_for,
)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lens, heads", [([1], 4), ([17, 300, 1000], 20), ([64, 5], 16),
                                        ([1, 31, 33, 70, 5], 16)])  # (batch 5: 32 tokens a step)
def test_the_kernel_equals_gathering_the_context(lens, heads, fp8):
    rank, rope, page, scale = 64, 16, 16, 0.1
    q_lat, q_pe, pools, table, ctx = paged_case(lens, heads, rank, rope, page, fp8)
    got = mla_decode_latent(q_lat, q_pe, pools, table, ctx, page, max(lens), scale)
    want = mla_decode_reference(q_lat.float(), q_pe.float(), as_float(pools),
                                table, ctx, page, max(lens), scale)
    assert got.shape == q_lat.shape and not got.isnan().any()
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()


def test_long_contexts_are_split_and_short_ones_are_not():
    assert splits_for(batch=1, heads=16, max_context=8192) > 1
    assert splits_for(batch=1, heads=16, max_context=10) == 1
    assert splits_for(batch=256, heads=16, max_context=8192) == 1  # the batch alone fills the GPU
    assert splits_for(batch=1, heads=16, max_context=1 << 20) == 128  # bounded, whatever the context


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_splits_sized_for_a_longer_context_than_any_give_the_same_answer(fp8):
    """A CUDA graph sizes the split count for the longest context the model takes; each
    sequence cuts its own context into at most that many parts, on the device, and the
    splits past its end stay empty (never read: their partials are poisoned here)."""
    lens, heads, rank, rope, page = [1, 700, 33], 16, 64, 16, 16
    q_lat, q_pe, pools, table, ctx = paged_case(lens, heads, rank, rope, page, fp8, seed=5)
    got = mla_decode_latent(q_lat, q_pe, pools, table, ctx, page, 1 << 17, 0.1)
    want = mla_decode_reference(q_lat.float(), q_pe.float(), as_float(pools), table, ctx, page, max(lens), 0.1)
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()


def test_mla_decode_through_the_absorbed_weights_equals_the_reference_path():
    """The model's call: the same answer on the kernel path as on the reference path."""
    lens, heads, rank, rope, page, dn, dv = [40, 9], 16, 64, 16, 16, 32, 24
    q_lat, q_pe, pools, table, ctx = paged_case(lens, heads, rank, rope, page, fp8=False, seed=3)
    gen = torch.Generator().manual_seed(4)
    q_nope = torch.randn(len(lens), heads, dn, generator=gen).to(torch.bfloat16).to(DEVICE)
    w_uk = (torch.randn(heads, dn, rank, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    w_uv = (torch.randn(heads, dv, rank, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    got = mla_decode(q_nope, q_pe, w_uk, w_uv, pools, table, ctx, page, max(lens), 0.1)
    q = torch.einsum("bhd,hdr->bhr", q_nope.float(), w_uk.float())
    ref = mla_decode_reference(q, q_pe.float(), as_float(pools), table, ctx,
                               page, max(lens), 0.1)
    want = torch.einsum("bhr,hvr->bhv", ref, w_uv.float())
    assert got.shape == (len(lens), heads, dv)
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()


def test_on_hopper_the_loop_copies_its_rows_ahead():
    """The pools' addresses are read from the address table (a graph replays against any
    cache), which tells the compiler nothing of their alignment: without `tl.multiple_of`
    its loads were neither vectorized nor pipelined (num_stages 1-3 within 1% on the H200),
    with it each step's rows are copied ahead asynchronously (compiled for sm_90 here)."""
    from hopper_compile import compile_for_hopper, count

    signature = {"q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "ptrs_ptr": "*i64", "table_ptr": "*i32",
                 "lens_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32", "heads": "i32", "scale": "fp32"} | {
        n: "i32" for n in ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_tb", "stride_ob", "stride_oh",
                           "stride_os")}
    constexprs = dict(R=512, DR=64, PAGE=16, CACHE="tl.bfloat16", FP8=False, DOT="tl.bfloat16", BLOCK_H=16,
                      BLOCK_N=16, MIN_SPLIT=16)
    ttgir = compile_for_hopper("preload.kernels.mla_decode", "_mla_decode_split", signature, constexprs)["ttgir"]
    assert count(ttgir, "async_copy_global_to_local") >= 2 and count(ttgir, "async_wait") >= 1


@pytest.mark.parametrize("heads", [2, 16, 128])
def test_the_warm_up_shapes_launch_every_variant_any_batch_and_context_would(heads):
    """An idle engine launches mla_decode_latent at launch_shapes (attention_warmup.py) so
    that serving compiles no variant of it mid-step: every (rows' step, split count's power
    of two) that any batch up to the limit and any context can pick is among theirs."""
    max_batch = 96
    shapes = launch_shapes(heads, max_batch)
    assert all(1 <= b <= max_batch and c >= 1 for b, c in shapes)

    def variant(batch, context):
        return block_n(batch), triton.next_power_of_2(splits_for(batch, heads, context))

    reachable = {variant(b, c) for b in range(1, max_batch + 1) for c in range(1, 2 * MAX_SPLITS * MIN_SPLIT, 7)}
    assert {variant(b, c) for b, c in shapes} == reachable
    assert len(shapes) == len(reachable)  # (one launch each)
