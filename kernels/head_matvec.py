"""Each head's vector times that head's matrix, for a decode step's few sequences (Triton):
the two products around MLA's absorbed attention, q_nope W_uk (into the latent space)
and the latent output times W_uv (out of it). The reference is the einsum of
`attention.per_head`, which the CPU (and a batch over ROWS) runs.

cuBLAS takes these as batched GEMMs of one row per head and spends 3.4 to 5.7 us on
each at V2-Lite's shapes on an H200 (16 heads, 2 MB of bf16), ten times what reading
the matrices takes. Here a program takes one head's block of output columns for every
sequence at once (up to ROWS, one tensor-core tile of rows), so each matrix is read
once, and all heads' blocks run side by side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.triton_dot import dot_dtype

ROWS = 16  # sequences up to which this kernel serves (its tile's rows); cuBLAS, more


# B, a step's rows, is not specialized (Triton would compile one variant for 1 row, one for
# 16 and one for the rest): the eager steps of serving meet every count, and a variant first
# met mid-step is compiled then, for seconds.
@triton.jit(do_not_specialize=["B"])
def _head_matvec(x_ptr, w_ptr, out_ptr, B, N, K, stride_xb, stride_xh, stride_wh, stride_wn, stride_wk,
                 stride_ob, stride_oh, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    h, pid_n = tl.program_id(0), tl.program_id(1)
    b = tl.arange(0, BLOCK_M)
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


def head_matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[b, h, n] = sum over k of x[b, h, k] w[h, n, k] in one launch: x [B <= ROWS, H, K]
    with K contiguous, w [H, N, K] any strided view (W_uk transposed, W_uv as stored)."""
    batch, heads, k = x.shape
    n = w.shape[1]
    if batch > ROWS or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} with strides {x.stride()}: at most {ROWS} rows, K contiguous")
    out = torch.empty(batch, heads, n, dtype=x.dtype, device=x.device)
    block_n = 64 if n >= 256 else 32  # (V2-Lite: 512 columns, 8 blocks a head; 128, 4)
    _head_matvec[(heads, triton.cdiv(n, block_n))](
        x, w, out, batch, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), DOT=dot_dtype(x.dtype), BLOCK_M=ROWS, BLOCK_N=block_n, BLOCK_K=128,
        num_warps=4, num_stages=3,
    )
    return out
