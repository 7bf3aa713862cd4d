"""Activations in e4m3 for the fp8 tensor cores (Triton): each row's values in groups of
GROUP columns, one float32 scale per group (amax / 448), as DeepSeek-V3 runs its fp8
GEMMs. With weights in e4m3 too (128 x 128 block scales), a K tile's product is
dot(a, w) * a_scale * w_scale: the matrix units' fp8 rate, twice bf16's on Hopper, where
dequantizing the weights to bf16 in registers leaves the product at the bf16 rate.

The reference is `fp8.quantize_block(x, (1, GROUP))`: the same scales and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.fp8 import FP8, FP8_MAX
from preload.kernels.launch import launcher
from preload.kernels.precision import QUANT_BLOCK

GROUP = QUANT_BLOCK[1]  # columns that share a scale: a weight block's width, so a K tile of both has one each
ROWS = 16  # rows a program quantizes


@triton.jit
def round_e4m3(x):
    """x (float32, within e4m3's range) rounded to e4m3's three mantissa bits, to nearest,
    ties to even, as the GPU's conversion rounds: the conversion that follows is then exact.
    (Triton's interpreter converts wrongly where rounding carries into the exponent,
    124 -> 64; values below e4m3's smallest normal, 2^-6, are left to the conversion.)"""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # (20 of float32's 23 mantissa bits go)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups(x_ptr, q_ptr, s_ptr, T, K, stride_xm, stride_qm, stride_sm, stride_sg, FP8_MAX: tl.constexpr,
                     ROWS: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / FP8_MAX
    q = round_e4m3(tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + group * stride_sg, scale, mask=rows < T)


def quantize_groups(x: torch.Tensor, scales_by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (rows contiguous) -> (e4m3 [T, K], float32 scales [T, ceil(K / GROUP)]), in one launch.
    `scales_by_column`: the scales stored a group's column after another (strides (1, T)),
    as cuBLASLt's block-scaled GEMM reads them (fp8_linear.py)."""
    t, k = x.shape
    groups = triton.cdiv(k, GROUP)
    q = torch.empty(t, k, dtype=FP8, device=x.device)
    if scales_by_column:
        scales = torch.empty(groups, t, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    if t:
        launcher(_quantize_groups)[(triton.cdiv(t, ROWS), groups)](
            x, q, scales, t, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), FP8_MAX=FP8_MAX,
            ROWS=ROWS, GROUP=GROUP)
    return q, scales
