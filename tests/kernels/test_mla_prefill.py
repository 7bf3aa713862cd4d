"""Chunked MLA prefill reads each sequence's context through its block table, in any order
of blocks, bf16 or e4m3 with per-row scales, a chunk of the flat context order at a time,
and gives what gathering the whole context and attending causally does (`mla_expanded`
with a [B, Q, K] mask). The batch mixes a prompt that is all new, continued prompts, and
a decode row; chunks end inside sequences and inside tiles. Both forms are checked: the
Triton kernel (in Triton's interpreter without a GPU, tests/conftest.py) and the torch
one. `-m gpu` adds the real models' shapes and the memory bound that is the point of it."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, paged_case  # noqa: E402

from preload.kernels import mla_prefill as kernel  # noqa: E402
from preload.kernels.attention import mla_expanded, paged_slots  # noqa: E402
from preload.kernels.prefill import mla_prefill_reference  # noqa: E402

SMALL = dict(dn=32, dr=16, dv=32, rank=64)
V2_LITE = dict(dn=128, dr=64, dv=128, rank=512)  # V3 has the same, with 128 heads
SCALE = 0.1


def prefill_case(lens: list[int], news: list[int], heads: int, dn: int, dr: int, dv: int, rank: int, page: int,
                 fp8: bool, seed: int = 0) -> dict:
    """Sequence b has lens[b] tokens cached, of which its last news[b] are this step's
    new tokens: their queries lie flat, sequence after sequence."""
    _, _, pools, table, ctx = paged_case(lens, heads, rank, dr, page, fp8, seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16).to(DEVICE)

    rows = sum(news)
    q_starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)
    return dict(q_nope=rand(rows, heads, dn), q_pe=rand(rows, heads, dr), kv_b=rand(heads * (dn + dv), rank, std=0.1),
                pools=pools, block_table=table, context_lens=ctx, q_starts=q_starts, block_size=page,
                max_context=max(lens), max_q=max(news), scale=SCALE)


def gathered(case: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The oracle: every context gathered whole, a causal [B, Q, K] mask, in float32 (or
    in bf16, as the engine ran prefill before: the bar for rounding at real shapes)."""
    c_kv, k_pe, c_scale, k_scale = case["pools"][:4]
    table, ctx, starts = case["block_table"], case["context_lens"].long(), case["q_starts"]
    news = starts.diff()
    slots = paged_slots(table, case["block_size"], case["max_context"])
    c, k = c_kv[slots].float(), k_pe[slots].float()
    if c_scale is not None:
        c, k = c * c_scale[slots], k * k_scale[slots]
    q = torch.arange(case["max_q"], device=DEVICE)
    valid = q < news[:, None]  # [B, Q]
    q_index = torch.where(valid, starts[:-1, None] + q, 0)
    q_pos = (ctx - news)[:, None] + q
    k_pos = torch.arange(case["max_context"], device=DEVICE)
    mask = (k_pos <= q_pos[..., None]) & (k_pos < ctx[:, None, None])
    q_nope, q_pe, kv_b, c, k = (x.to(dtype) for x in (case["q_nope"][q_index], case["q_pe"][q_index], case["kv_b"], c, k))
    return mla_expanded(q_nope, q_pe, c, k, kv_b, mask, case["scale"])[valid].float()


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 3e-2):
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert not got.isnan().any()
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


# (contexts, new tokens of each): a prompt all new, continued prompts, a decode row.
BATCHES = {
    "mixed": ([40, 75, 1, 23], [40, 30, 1, 5]),
    "decode-beside-long": ([3, 100], [1, 50]),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("chunk", [24, 4096], ids=["chunks-of-24", "one-chunk"])
@pytest.mark.parametrize("batch, heads", [("mixed", 4), ("decode-beside-long", 3)])
def test_the_kernel_equals_gathering_the_context(batch, heads, chunk, fp8):
    lens, news = BATCHES[batch]
    case = prefill_case(lens, news, heads, **SMALL, page=16, fp8=fp8)
    assert_close(kernel.mla_prefill(**case, chunk=chunk), gathered(case))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_reference_equals_gathering_the_context(batch, fp8):
    lens, news = BATCHES[batch]
    case = prefill_case(lens, news, 6, **SMALL, page=16, fp8=fp8, seed=2)
    assert_close(mla_prefill_reference(**case, chunk=24), gathered(case))


def test_head_dims_that_are_no_power_of_two_read_no_other_heads_keys():
    """The GPU tests' small checkpoint has a rope part of 8 (narrower than the kernel's
    smallest tile, 16) and v of 12: a tile reaches into the next head's columns or past the
    row, and its extra columns must count for nothing (on an H100, a k_pe tile wider than
    k_pe's rows was an illegal instruction)."""
    lens, news = BATCHES["mixed"]
    case = prefill_case(lens, news, 4, dn=16, dr=8, dv=12, rank=16, page=16, fp8=False, seed=4)
    assert_close(kernel.mla_prefill(**case, chunk=24), gathered(case))


def test_every_row_is_written_and_no_state_is_read_before_it_is(monkeypatch):
    """The output and the running state start as NaN: a row never written, or state read
    before this call wrote it, shows. The host's count of context tokens spares a sync."""
    lens, news = [50, 1, 33, 20], [50, 1, 2, 20]
    case = prefill_case(lens, news, 4, **SMALL, page=8, fp8=False, seed=5)
    make = kernel._state_buffers
    monkeypatch.setattr(kernel, "_state_buffers", lambda *a: tuple(x.fill_(float("nan")) for x in make(*a)))
    out = torch.full((sum(news), 4, SMALL["dv"]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = kernel.mla_prefill(**case, chunk=16, out=out, context_tokens=sum(lens))
    assert got is out
    assert_close(out, gathered(case))


def test_head_dims_that_are_not_powers_of_two():
    """Tiles are powers of two: the dims are padded in them and masked."""
    case = prefill_case([37, 12], [20, 12], 3, dn=24, dr=8, dv=40, rank=48, page=16, fp8=False, seed=7)
    assert_close(kernel.mla_prefill(**case, chunk=20), gathered(case))


def test_a_chunk_is_counted_in_tokens_of_all_the_contexts_together(monkeypatch):
    """Chunks run over the contexts laid end to end: a chunk's size does not grow with the
    batch. Four contexts of 10 in chunks of 16 take three chunks (16 + 16 + 8)."""
    case = prefill_case([10] * 4, [10] * 4, 2, **SMALL, page=4, fp8=False, seed=9)
    seen, real = [], kernel.chunk_latents

    def spy(pools, slots, dtype):
        seen.append(len(slots))
        return real(pools, slots, dtype)

    monkeypatch.setattr(kernel, "chunk_latents", spy)
    assert_close(kernel.mla_prefill(**case, chunk=16), gathered(case))
    assert seen == [16, 16, 8]


# On the GPU: the real models' shapes, a few thousand tokens, and the memory bound.


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads, lens, news", [
    (16, [3000, 1500, 700, 1], [2000, 1500, 64, 1]),  # V2-Lite
    (128, [2048, 600, 1], [1024, 600, 1]),  # V3's heads
], ids=["v2-lite", "v3-heads"])
def test_the_kernel_at_the_real_models_shapes(heads, lens, news, fp8):
    """At rank 512 the scores are larger and peakier, and bf16 keys and values round them
    more than in the small cases: the measure is the float32 oracle's distance from the
    bf16 path that prefill took before (about 1.3% of its norm on an H200; the kernel,
    0.4% with a bf16 cache, 0.6% with e4m3)."""
    case = prefill_case(lens, news, heads, **V2_LITE, page=64, fp8=fp8, seed=11)
    want = gathered(case)
    bar = (gathered(case, torch.bfloat16) - want).norm() / want.norm()
    for got in (kernel.mla_prefill(**case, chunk=1024), kernel.mla_prefill(**case),  # chunks merged, and the default
                mla_prefill_reference(**case, chunk=1024)):
        assert got.shape == want.shape and not got.isnan().any()
        err = (got.float() - want).norm() / want.norm()
        assert err < min(bar, 1e-2), (err, bar)
        assert (got.float() - want).abs().max() < 2e-2 * want.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("context, new", [(8192, 8192), (32768, 512), (32768, 32768)],
                         ids=["8k-prompt", "512-after-32k", "32k-prompt"])
def test_memory_grows_with_the_chunk_not_with_queries_times_context(context, new):
    """Peak memory of a call: the chunk's keys and values and its gathered latents, plus
    per-query state and the output; nothing of size queries x context."""
    heads, dims, chunk = 16, V2_LITE, 2048
    case = prefill_case([context], [new], heads, **dims, page=64, fp8=True, seed=13)
    kernel.mla_prefill(**case, chunk=chunk)  # first: compiling, and cuBLAS's workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kernel.mla_prefill(**case, chunk=chunk)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    keys = chunk * heads * (dims["dn"] + dims["dv"]) * 2  # bf16
    latents = chunk * (dims["rank"] + dims["dr"]) * 16  # e4m3 rows, float32 twice, bf16, with room
    per_query = new * heads * (dims["dv"] * (4 + 2) + 2 * 4)  # state and output
    bound = keys + latents + per_query + (4 << 20)
    assert grown <= bound, (grown, bound)
    assert bound < new * context * heads * 4 / 8  # far below one float32 score per query, key and head


def test_on_hopper_the_keys_and_values_come_by_tma():
    """Compiled for sm_90 at V2-Lite's shapes and the GPU's tiles, the kernel's k_nope, k_pe
    and v tiles are bulk tensor copies (TMA), not pointer loads (10% slower at every prompt
    shape on an H100: scripts/probe_prefill_attention.py)."""
    from hopper_compile import compile_for_hopper, count
    from kernel_specs import PREFILL_ATTENTION, PREFILL_ATTENTION_CONSTEXPRS

    constexprs = PREFILL_ATTENTION_CONSTEXPRS | dict(FINAL=False, DOT="tl.bfloat16")
    ptx = compile_for_hopper("preload.kernels.mla_prefill", "_prefill_chunk", PREFILL_ATTENTION, constexprs,
                             num_warps=8)["ptx"]
    assert count(ptx, "cp.async.bulk.tensor") >= 3
