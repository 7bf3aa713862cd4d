"""Storing new tokens' latents in the paged cache on the GPU (Triton): one launch for a
layer's c_kv and k_pe rows, quantized to e4m3 with a scale per row for an fp8 cache.
The reference is the torch path of `attention.write_latents` (and `quantize_rows`).

The cache is found through `Pools.ptrs` (its addresses, read on the device), not through
arguments, so that a CUDA graph captured with one cache writes into whichever cache's
addresses are there when it replays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from preload.kernels.fp8 import FP8_MAX
from preload.kernels.launch import launcher
from preload.kernels.triton_dot import TRITON_DTYPES

if TYPE_CHECKING:  # (attention.py imports this module where it dispatches to it)
    from preload.kernels.attention import Pools


@triton.jit
def _store_row(ptrs_ptr, which, slot, src, WIDTH: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr,
               FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < WIDTH
    x = tl.load(src + i, mask=live, other=0.0).to(tl.float32)
    # (16-byte aligned, as every pool: said, so that a row is stored in vectors, not element by element)
    pool = tl.multiple_of(tl.load(ptrs_ptr + which).to(tl.pointer_type(CACHE)), 16)
    if FP8:  # as quantize_rows: scale = max(amax, 1e-12) / 448, rows stored as x / scale
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
        tl.store(pool + slot * WIDTH + i, (x / scale).to(CACHE), mask=live)
        tl.store(tl.load(ptrs_ptr + which + 2).to(tl.pointer_type(tl.float32)) + slot, scale)
    else:
        tl.store(pool + slot * WIDTH + i, x.to(CACHE), mask=live)


@triton.jit
def _write_latents(ptrs_ptr, slots_ptr, c_ptr, k_ptr, stride_c, stride_k,
                   R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                   CACHE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    _store_row(ptrs_ptr, 0, slot, c_ptr + t * stride_c, R, BLOCK_R, CACHE, FP8, FP8_MAX)
    _store_row(ptrs_ptr, 1, slot, k_ptr + t * stride_k, DR, BLOCK_DR, CACHE, FP8, FP8_MAX)


def write_latents_triton(pools: Pools, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """c_kv [T, r] and k_pe [T, dr] (rows contiguous) into the pools at slots [T]."""
    t, rank = c_kv.shape
    rope = k_pe.shape[1]
    if t == 0:
        return
    c_kv, k_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (c_kv, k_pe))
    launcher(_write_latents)[(t,)](
        pools.ptrs, slots, c_kv, k_pe, c_kv.stride(0), k_pe.stride(0),
        R=rank, DR=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_DR=triton.next_power_of_2(rope),
        CACHE=TRITON_DTYPES[pools.c_kv.dtype], FP8=pools.c_scale is not None, FP8_MAX=FP8_MAX,
        num_warps=4 if rank >= 256 else 1,
    )
