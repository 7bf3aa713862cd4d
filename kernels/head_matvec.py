"""Each head's vector times that head's matrix, for a decode step's sequences (Triton):
the two products around MLA's absorbed attention, q_nope W_uk (into the latent space)
and the latent output times W_uv (out of it). The reference is the einsum of
`attention.per_head`, which the CPU runs.

cuBLAS takes these as batched GEMMs of one row per head and spends 3.4 to 5.7 us on
each at V2-Lite's shapes on an H200 (16 heads, 2 MB of bf16), ten times what reading
the matrices takes. Here a program takes one head's block of output columns for a
tile of sequences (all of a few, up to ROWS, in one tile: each matrix read once), and
all heads' blocks run side by side. Past ROWS, tiles of WIDE_ROWS: the einsum there
writes [H, B, N] and hands back a transposed view, which the attention kernel's
contiguous query and the output projection's flattened rows each copied once more (two
launches a layer, 3 us each on an H100 at batch 100); this kernel writes [B, H, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher
from preload.kernels.triton_dot import dot_dtype

ROWS = 16  # sequences a step's tile of rows takes at most: one tile, each matrix read once
WIDE_ROWS = 64  # past ROWS: a tensor-core tile of rows each program (the matrices are 2 MB: read again per tile)


# B, a step's rows, is not specialized (Triton would compile one variant for 1 row, one for
# 16 and one for the rest): the eager steps of serving meet every count, and a variant first
# met mid-step is compiled then, for seconds.
@triton.jit(do_not_specialize=["B"])
def _head_matvec(x_ptr, w_ptr, out_ptr, B, N, K, stride_xb, stride_xh, stride_wh, stride_wn, stride_wk,
                 stride_ob, stride_oh, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    h, pid_n, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + b[:, None] * stride_xb + h * stride_xh + k[None, :], mask=(b[:, None] < B) & (k[None, :] < K),
                    other=0.0)
        # [BLOCK_K, BLOCK_N] whichever of n and k is contiguous (a stride of 1 is compiled in).
        w = tl.load(w_ptr + h * stride_wh + n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
        acc += tl.dot(x.to(DOT), w.to(DOT))
    tl.store(out_ptr + b[:, None] * stride_ob + h * stride_oh + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(b[:, None] < B) & (n[None, :] < N))


def head_matvec(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, h, n] = sum over k of x[b, h, k] w[h, n, k] in one launch, out contiguous (or
    the given `out` [B, H, N], N contiguous): x [B, H, K] with K contiguous, w [H, N, K] any
    strided view (W_uk transposed, W_uv as stored)."""
    batch, heads, k = x.shape
    n = w.shape[1]
    if x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} with strides {x.stride()}: K must be contiguous")
    if out is None:
        out = torch.empty(batch, heads, n, dtype=x.dtype, device=x.device)
    elif out.shape != (batch, heads, n) or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} with strides {out.stride()}: [{batch}, {heads}, {n}], N contiguous")
    block_n = 64 if n >= 256 else 32  # (V2-Lite: 512 columns, 8 blocks a head; 128, 4)
    block_m = ROWS if batch <= ROWS else WIDE_ROWS
    launcher(_head_matvec)[(heads, triton.cdiv(n, block_n), triton.cdiv(batch, block_m))](
        x, w, out, batch, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), DOT=dot_dtype(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
        num_warps=4, num_stages=3,
    )
    return out
