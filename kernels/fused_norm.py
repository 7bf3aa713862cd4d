"""RMSNorm in one launch (Triton), optionally with the residual add before it fused in.
`norm.rms_norm` is the reference: float32 statistics, the normalized row cast back to
the activations' dtype, then multiplied by the weight in torch's promoted dtype.

A decode step norms a few rows of 512 to 7168 values, so each program takes one whole
row in registers: read once, reduced, written once. The pre-norm block's
`h = x + attn(x); norm(h)` becomes `add_rms_norm`, which also writes h, rounded to the
activations' dtype exactly as torch's `x + y` rounds it, since the next residual add
reads it.

Rounding is done by `round_to`, not by casts: the Triton interpreter (the tests' way to
run kernels without a GPU) truncates float32 to bf16 instead of rounding to nearest
even, so the bits are rounded by hand; on the GPU this is a few integer operations on a
kernel that waits on memory anyway, and the same code is tested on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher


@triton.jit
def round_to(x, DT: tl.constexpr):
    """float32 x rounded to nearest even in DT's precision, kept as float32: what torch
    gives for one bf16/fp16 operation computed in float32 and stored."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, D, eps,
    stride_x, stride_r, stride_o, stride_s,
    ADD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One row: out = w * (h / rms(h)).to(act), with h = x (ADD False) or x + r, stored
    to sum_ptr. act is sum_ptr's dtype (the caller passes x as sum_ptr without ADD)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    live = d < D
    act: tl.constexpr = sum_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + d, mask=live, other=0.0).to(tl.float32)
    if ADD:
        h = round_to(h + tl.load(r_ptr + row * stride_r + d, mask=live, other=0.0).to(tl.float32), act)
        tl.store(sum_ptr + row * stride_s + d, h.to(act), mask=live)
    normed = round_to(h * tl.rsqrt(tl.sum(h * h, 0) / D + eps), act)
    w = tl.load(w_ptr + d, mask=live, other=0.0).to(tl.float32)
    out_dt: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + d, round_to(w * normed, out_dt).to(out_dt), mask=live)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [rows, D] with unit stride along D: a view where one exists (the
    split halves of a projection's output are), a copy otherwise."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _warps(block_d: int) -> int:
    # A whole row per program, more threads for wider rows (as measured on an H200 inside
    # CUDA graphs: 4 warps for 512 values, 4 or 8 for 1536, 16 for 7168).
    return 4 if block_d <= 1024 else 8 if block_d <= 4096 else 16


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {d}")
    rows = _rows(x)
    act = x.dtype
    res = h = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
        res = _rows(residual)
        act = torch.promote_types(x.dtype, residual.dtype)
        h = torch.empty(rows.shape, dtype=act, device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, act), device=x.device)
    block_d = triton.next_power_of_2(d)
    launcher(_rms_norm)[(rows.shape[0],)](
        rows, res if res is not None else rows, weight.contiguous(), out, h if h is not None else rows, d, eps,
        rows.stride(0), res.stride(0) if res is not None else 0, out.stride(0), h.stride(0) if h is not None else 0,
        ADD=residual is not None, BLOCK_D=block_d, num_warps=_warps(block_d),
    )
    return out.view(x.shape), (h.view(x.shape) if h is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm.rms_norm in one launch: x [..., D] (rows may be strided), weight [D]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch, the sum rounded as torch's."""
    out, h = _launch(x, residual, weight, eps)
    return out, h
