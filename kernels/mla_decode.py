"""MLA decode attention on the GPU (Triton): one new token per sequence, all heads against
the sequence's latent cache, read in place through its block table. The reference it is
tested against is `attention.mla_decode_reference` (gather, then `latent_attention`).

In the absorbed form a head's query is q_latent = q_nope W_uk (kv_lora_rank wide) plus
its roped part q_pe, and a cached token is its latent c_kv and its roped key k_pe: the
score is q_latent . c_kv + q_pe . k_pe, and the output (before W_uv) is the softmax-
weighted sum of the c_kv. All heads share the token's row, so one program takes
BLOCK_H heads of one sequence over a range of its context, reading each cached row once
for all of them.

Long contexts are split (flash-decoding): each split writes its partial output and
log-sum-exp, and a second kernel combines them, so that a single sequence still keeps
every multiprocessor busy. The number of splits follows the longest context the step
may have; each sequence's split length follows its own context, read on the device, so
a CUDA graph captured once serves every context length.

The cache is read through `Pools.ptrs` (its addresses on the device), so that a graph
captured against one cache serves another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher
from preload.kernels.triton_dot import TRITON_DTYPES, dot_dtype

if TYPE_CHECKING:  # (attention.py imports this module where it dispatches to it)
    from preload.kernels.attention import Pools

# Swept on an H200 inside CUDA graphs at V2-Lite's shapes (16 heads, rank 512), batch 1 to
# 256, contexts 1k and 8k (results/kernels/moe-tiles-h200.json, "mla"): short steps of the loop
# and short splits kept more loads in flight while the loads were not pipelined (block_n now
# says otherwise from batch 4); 4 warps beat 8 everywhere but at batch 1.
BLOCK_H = 16  # heads per program: the smallest tile a tensor-core dot takes
MIN_SPLIT = 16  # tokens a split covers at least (batch 1, 1k context: 5.9 us against 11.7 with 64)
TARGET_PROGRAMS = 264  # about two per multiprocessor of an H200 (132)
MAX_SPLITS = 128  # a graph sizes its splits for the longest context: bounds the partials it keeps


@triton.jit
def _split_len(ctx, splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tokens each split of a sequence covers: as many splits as there are programs
    (a graph fixes only how many), none shorter than MIN_SPLIT; the rest stay empty."""
    return tl.cdiv(tl.maximum(tl.cdiv(ctx, splits), MIN_SPLIT), BLOCK_N) * BLOCK_N


# What changes from one eager step to the next is not specialized: the table's and the
# lengths' addresses (AttentionMeta packs them behind the batch's other numbers, so their
# alignment follows the batch size), the table's width, the split count (1 or not). Each
# would be a variant compiled when first met, mid-step; they only index scalar loads.
@triton.jit(do_not_specialize=["table_ptr", "lens_ptr", "stride_tb"])
def _mla_decode_split(
    q_lat_ptr, q_pe_ptr, ptrs_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
    heads, scale,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_tb, stride_ob, stride_oh, stride_os,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, CACHE: tl.constexpr, FP8: tl.constexpr,
    DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    b, hb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    split_len = _split_len(ctx, tl.num_programs(2), MIN_SPLIT, BLOCK_N)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    if lo >= hi:  # past the sequence's end: the combine reads only the splits that wrote
        return
    # Addresses read from the table say nothing of their alignment: told it (pools start at
    # 256-byte offsets, kv_cache.CacheMemory), the compiler vectorizes the rows' loads and
    # copies them a step ahead (num_stages); without it each step waited for its own rows.
    c_kv_ptr = tl.multiple_of(tl.load(ptrs_ptr).to(tl.pointer_type(CACHE)), 16)
    k_pe_ptr = tl.multiple_of(tl.load(ptrs_ptr + 1).to(tl.pointer_type(CACHE)), 16)
    r, dr = tl.arange(0, R), tl.arange(0, DR)
    q_lat = tl.load(q_lat_ptr + b * stride_qb + h[:, None] * stride_qh + r[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + b * stride_pb + h[:, None] * stride_ph + dr[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, R), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < hi
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE, mask=live, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        c = tl.load(c_kv_ptr + slot[:, None] * R + r[None, :], mask=live[:, None], other=0.0)
        k = tl.load(k_pe_ptr + slot[:, None] * DR + dr[None, :], mask=live[:, None], other=0.0)
        if FP8:  # e4m3 rows with one float32 scale each
            c_scale_ptr = tl.load(ptrs_ptr + 2).to(tl.pointer_type(tl.float32))
            k_scale_ptr = tl.load(ptrs_ptr + 3).to(tl.pointer_type(tl.float32))
            c = c.to(tl.float32) * tl.load(c_scale_ptr + slot, mask=live, other=0.0)[:, None]
            k = k.to(tl.float32) * tl.load(k_scale_ptr + slot, mask=live, other=0.0)[:, None]
        c = c.to(DOT)
        s = tl.dot(q_lat.to(DOT), tl.trans(c)) + tl.dot(q_pe.to(DOT), tl.trans(k.to(DOT)))
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), c)
        m = m_new
    base = b * stride_ob + h * stride_oh + split * stride_os
    tl.store(out_ptr + base[:, None] + r[None, :], acc / l[:, None], mask=hmask[:, None])
    tl.store(lse_ptr + (b * heads + h) * tl.num_programs(2) + split, m + tl.log(l), mask=hmask)


@triton.jit(do_not_specialize=["lens_ptr", "splits"])
def _mla_decode_combine(parts_ptr, lse_ptr, lens_ptr, out_ptr, heads, splits,
                        stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                        SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                        MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[b, h, r-block]: the used splits' parts weighed by their share of the softmax."""
    b, h, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    used = tl.cdiv(ctx, _split_len(ctx, splits, MIN_SPLIT, BLOCK_N))  # the splits that wrote a part
    lse_row = lse_ptr + (b * heads + h) * splits
    s = tl.arange(0, SPLITS)
    lse = tl.load(lse_row + s, mask=s < used, other=float("-inf"))
    top = tl.max(lse, 0)
    total = tl.sum(tl.exp(lse - top), 0)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for first in range(0, used, CHUNK):  # a chunk of splits at a time: [CHUNK, BLOCK_R] in registers
        sc = first + tl.arange(0, CHUNK)
        w = tl.exp(tl.load(lse_row + sc, mask=sc < used, other=float("-inf")) - top)
        parts = tl.load(parts_ptr + b * stride_pb + h * stride_ph + sc[:, None] * stride_ps + r[None, :],
                        mask=(sc < used)[:, None], other=0.0)
        acc += tl.sum(parts * w[:, None], 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, (acc / total).to(out_ptr.dtype.element_ty))


def block_n(batch: int) -> int:
    """Context tokens per step of the loop. Once the rows' loads are pipelined (the pools'
    alignment, above) longer steps win from batch 4: the whole call at 64 x 1k 42.5 us with
    32 against 50.8 with 16, 128 x 4k 230 against 312, within 4% of 64's best everywhere
    from 4 to 128; batch 1 keeps 16 (1k: 8.4 against 9.1), a split being at least one step
    long (H100; results/kernels/mla-block-h100.json)."""
    return 16 if batch < 4 else 32


def combine_tile(splits: int, rank: int) -> tuple[int, int]:
    """The combine's splits a loop step (CHUNK) and rank columns a program (BLOCK_R): a tile
    of 4,096 values for one warp. Few splits (serving's batches) then take the whole rank in
    one program, many (batch 1) a quarter of it: at 128 x 1k (3 splits) 4.4 us a layer
    against 25.1 with 128 columns and 4 warps, 64 x 1k 4.0 against 14.3, batch 1 at 128
    splits 3.1 against 4.8 (H100; results/kernels/mla-combine-h100.json)."""
    chunk = min(32, triton.next_power_of_2(splits))
    return chunk, min(rank, 4096 // chunk)


def splits_for(batch: int, heads: int, max_context: int) -> int:
    """How many parts each sequence's context may be cut into: enough programs to fill the
    GPU without starting a wave it would not fill (128 x 1k: 2 splits 66.9 us, 3 79.9; 128 x 2k
    119.5 against 143; H100, 32 tokens a step, results/kernels/mla-serving-aligned-h100.json),
    none shorter than MIN_SPLIT tokens at max_context, at most MAX_SPLITS."""
    programs = batch * triton.cdiv(heads, BLOCK_H)
    return max(1, min(TARGET_PROGRAMS // programs, triton.cdiv(max_context, MIN_SPLIT), MAX_SPLITS))


def mla_decode_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, pools: Pools, block_table: torch.Tensor,
                      context_lens: torch.Tensor, block_size: int, max_context: int, scale: float) -> torch.Tensor:
    """softmax(scale (q_lat c_kv^T + q_pe k_pe^T)) c_kv for each sequence over its context:
    q_lat [B, H, R], q_pe [B, H, DR]; one layer's pools (read through pools.ptrs);
    block_table [B, NB], context_lens [B] (no longer than max_context). -> [B, H, R]."""
    batch, heads, rank = q_lat.shape
    splits, bn = splits_for(batch, heads, max_context), block_n(batch)  # (both kernels cut the splits alike)
    parts = torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q_lat.device)
    launcher(_mla_decode_split)[(batch, triton.cdiv(heads, BLOCK_H), splits)](
        q_lat, q_pe, pools.ptrs, block_table, context_lens, parts, lse, heads, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        R=rank, DR=q_pe.shape[-1], PAGE=block_size, CACHE=TRITON_DTYPES[pools.c_kv.dtype],
        FP8=pools.c_scale is not None, DOT=dot_dtype(q_lat.dtype), BLOCK_H=BLOCK_H, BLOCK_N=bn,
        MIN_SPLIT=MIN_SPLIT, num_warps=4,
    )
    out = torch.empty_like(q_lat)
    chunk, block_r = combine_tile(splits, rank)
    launcher(_mla_decode_combine)[(batch, heads, rank // block_r)](
        parts, lse, context_lens, out, heads, splits, parts.stride(0), parts.stride(1), parts.stride(2), out.stride(0),
        out.stride(1), SPLITS=triton.next_power_of_2(splits), CHUNK=chunk, BLOCK_R=block_r, MIN_SPLIT=MIN_SPLIT,
        BLOCK_N=bn, num_warps=1,
    )
    return out


def launch_shapes(heads: int, max_batch: int) -> list[tuple[int, int]]:
    """(batch, max_context) pairs that between them launch every variant of the two kernels
    mla_decode_latent may compile for up to `max_batch` rows: their constexprs follow the
    batch (block_n) and the split count (SPLITS, and combine_tile from it, a power of two),
    which stops growing at MAX_SPLITS x MIN_SPLIT tokens of context; the smallest batch for
    each (Engine warms them while idle: attention_warmup.py)."""
    shapes: dict[tuple[int, int], tuple[int, int]] = {}
    for batch in range(1, max_batch + 1):
        for context in (MIN_SPLIT << k for k in range(MAX_SPLITS.bit_length())):
            key = (block_n(batch), triton.next_power_of_2(splits_for(batch, heads, context)))
            shapes.setdefault(key, (batch, context))
    return sorted(shapes.values())
