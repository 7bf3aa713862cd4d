"""Each token's k routed expert outputs summed, plus the shared experts' output, in one
pass (Triton). The grouped GEMMs leave a row per (token, expert) pair, a token's k rows
adjacent; torch's form, `y.view(T, k, D).sum(1) + shared` (`sum_pairs_reference` here),
runs as a reduction and an addition, two passes over the rows at a fraction of the HBM's speed
(a 2,048-token step of V2-Lite on an H200: 29 us a layer for the reduction alone, where
its 58 MB take 12 us to read and write). Here the k rows and the shared row are added in
float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher

BLOCK_T = 4  # tokens a program sums
BLOCK_D = 512  # columns a program sums


# Not specialized on `tokens`: Triton compiles a variant per integer argument's divisibility
# by 16 (and for 1), and a step's token count varies, so serving would meet variants the
# warm-up had not (mla_prefill.py's `lo` and `hi` likewise).
@triton.jit(do_not_specialize=["tokens"])
def _sum_pairs(y_ptr, add_ptr, out_ptr, tokens, D, stride_y, stride_add, stride_out,
               TOP_K: tl.constexpr, ADD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    keep = (t < tokens)[:, None] & (d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if ADD:
        acc += tl.load(add_ptr + t[:, None] * stride_add + d[None, :], mask=keep, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j)[:, None] * stride_y + d[None, :], mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_out + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)


def sum_pairs_reference(y: torch.Tensor, top_k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """What `sum_pairs` computes, in torch: float32, rounded once."""
    out = y.float().view(-1, top_k, y.shape[1]).sum(1)
    return (out if add is None else out + add.float()).to(y.dtype)


def sum_pairs(y: torch.Tensor, top_k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """y [T * k, D], token t's rows t*k .. t*k+k-1 -> [T, D] their sum (+ add [T, D])."""
    pairs, d = y.shape
    tokens = pairs // top_k
    out = torch.empty(tokens, d, dtype=y.dtype, device=y.device)
    if tokens == 0:
        return out
    grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(d, BLOCK_D))
    launcher(_sum_pairs)[grid](y, add if add is not None else out, out, tokens, d, y.stride(0),
                               add.stride(0) if add is not None else 0, out.stride(0),
                               TOP_K=top_k, ADD=add is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    return out
