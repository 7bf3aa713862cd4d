"""Split-K for the matrix-vector products of a decode step (fp8_linear.py).

A few rows times a matrix is all reading the matrix, and tiled only over its output
columns it leaves most of a GPU idle (576 columns in blocks of 32: 18 programs on 132
SMs). So the reduction over K is cut into slices as well, each slice a program that
writes float32 partial sums. The last slice of a column block to finish (an atomic
arrival counter tells it) adds the slices up in slice order, so the result does not
depend on which ran first (a replayed graph gives what the eager step gives), applies
what comes after (SiLU times the up projection), and writes the output: one launch,
no separate reduction kernel.

The counters are one buffer per device, each back at zero when its launch ends (the
last slice resets it): launches share them, which is safe because the engine runs its
kernels on one stream, one after another.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

COUNTERS = 1 << 16  # (row, column block) pairs a launch may have


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def slices(tiles: int, programs: int, device: torch.device, splits: int | None = None) -> tuple[int, int]:
    """(splits, tiles per split) for a reduction of `tiles` K tiles beside `programs`
    programs: enough to fill the GPU twice over (or `splits`), none empty."""
    if programs > COUNTERS:
        raise ValueError(f"{programs} programs before split-K: more than the {COUNTERS} arrival counters")
    if splits is None:
        sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
        splits = max(1, min(tiles, triton.cdiv(2 * sms, programs)))
    per = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per), per


@triton.jit
def combine_splits(acc, acc2, part_ptr, at, mask, counter_ptr, split, stride_ps,
                   SPLITS: tl.constexpr, SWIGLU: tl.constexpr):
    """(out, last): this slice's float32 sums `acc` (and `acc2`, the up projection's,
    with SWIGLU) stored at part[split] + at; if it is the last of SPLITS to arrive,
    the sum of every slice in slice order (SWIGLU: silu(sum) * sum2) and True."""
    last = True
    if SPLITS > 1:
        tl.store(part_ptr + split * stride_ps + at, acc, mask=mask)
        if SWIGLU:
            tl.store(part_ptr + (SPLITS + split) * stride_ps + at, acc2, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the (releasing) arrival
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == SPLITS - 1
        if last:
            acc = tl.zeros_like(acc)
            acc2 = tl.zeros_like(acc2)
            # In slice order (the sum does not depend on who came last), unrolled: every
            # slice's load in flight at once, not one L2 round trip after another.
            for s in tl.static_range(SPLITS):
                acc += tl.load(part_ptr + s * stride_ps + at, mask=mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc2 += tl.load(part_ptr + (SPLITS + s) * stride_ps + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    return acc, last


@triton.jit
def row_dot(x_ptr, w_ptr, s_ptr, cols, N, K, first, end, stride_wn, stride_sn, stride_sk,
             FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, SUB: tl.constexpr):
    """sum over K tiles first..end-1 of one row x . W[cols] (times the blocks' scales, FP8),
    in float32 on the CUDA cores: for one row a tensor-core tile of 16 would be 15 rows of
    padding. W's K is contiguous. SUB tiles at a time: the loads of one iteration are all
    that is in flight (nothing feeds a tensor-core dot, so Triton does not pipeline them),
    so an iteration reads several tiles, each a [BLOCK_N, BLOCK_K] slab with its own scale
    per row."""
    ks = tl.arange(0, BLOCK_K)
    sub = tl.arange(0, SUB)
    acc = tl.zeros((BLOCK_N, SUB), dtype=tl.float32)
    for kb in range(first, end, SUB):
        tile = kb + sub
        k = tile[:, None] * BLOCK_K + ks[None, :]  # [SUB, BLOCK_K]
        k_mask = (tile[:, None] < end) & (k < K)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None, None] * stride_wn + k[None, :, :],
                    mask=(cols[:, None, None] < N) & k_mask[None, :, :], other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :, :], 2)  # [BLOCK_N, SUB]
        if FP8:  # within a K tile a block's scale is one per row of W
            s = tl.load(s_ptr + (cols // SCALE_N)[:, None] * stride_sn + (tile * BLOCK_K // SCALE_K)[None, :] * stride_sk,
                        mask=(cols[:, None] < N) & (tile[None, :] < end), other=0.0)
            part = part * s
        acc += part
    return tl.sum(acc, 1)


def partials(splits: int, swiglu: bool, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The float32 buffer of the slices' sums (and the up projection's, with SwiGLU)."""
    return torch.empty((2 * splits if swiglu else splits) if splits > 1 else 1, *shape, dtype=torch.float32, device=device)
