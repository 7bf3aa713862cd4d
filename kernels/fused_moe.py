"""Mixture-of-experts on the GPU: every routed expert of every token in two grouped
GEMMs, with no host sync (Triton). `moe.moe_experts` is the reference it is tested against.
The same kernel, with one expert, is the fp8 linear layer for many rows (fp8_linear.py).

1. `align_by_expert`: the batch's (token, k) pairs sorted by expert on the device, each
   expert's run padded to a multiple of BLOCK_M, so that a block of rows needs one
   expert. The sizes are bounds known from the batch's shape, not counts read back.
   (Torch here, the reference; the steps run moe_align.py's one Triton launch.)
2. gate and up in one grouped GEMM with SwiGLU fused: h[pair] = silu(x Wg^T) * (x Wu^T).
3. down in a second one, scaled by the pair's routing weight; the k rows of a token
   are then summed.

Experts' weights are read where they lie, in their stored form: a strided view over all
experts of a layer (`stack_experts`), bf16 or e4m3 with block scales (a per-tensor scale
is one block), dequantized in registers. A decode step thus reads each chosen expert's
weights once and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.moe_align import align_by_expert_triton
from preload.kernels.quant import Fp8Weight, Weight, kernel_parts, scale_block
from preload.kernels.triton_dot import dot_dtype


def stack_experts(weights: list[Weight]) -> Weight:
    """One [E, N, K] view of E experts' matrices (and [E, n, k] of their scales) without a
    copy where they lie at one stride apart (as the daemon's arena stores them); a copy
    otherwise."""
    if isinstance(weights[0], Fp8Weight):
        return Fp8Weight(_stack([w.q for w in weights]), _stack([w.scale_inv for w in weights]), weights[0].block)
    return _stack(weights)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    step = tensors[1].data_ptr() - first.data_ptr() if len(tensors) > 1 else 0
    storage = first.untyped_storage().data_ptr()
    evenly = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
                 and t.untyped_storage().data_ptr() == storage  # separate allocations may also lie evenly apart
                 and t.data_ptr() - first.data_ptr() == i * step for i, t in enumerate(tensors))
    if not (evenly and step % first.element_size() == 0 and step > 0):
        return torch.stack(tensors)
    return first.as_strided((len(tensors), *first.shape), (step // first.element_size(), *first.stride()))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_pairs, block_expert, padded_rows): the pair indices (token * k + slot)
    grouped by expert, each group padded to a multiple of block_m with the index P (no
    pair); the expert of each block of block_m rows; the number of rows in use, as a
    one-element tensor. Only device work: the buffers have their largest possible size."""
    flat = topk_ids.flatten()
    pairs, dev = flat.numel(), flat.device
    # (not bincount: on CUDA it reads the largest id back to size its output)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[experts]
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs[ends[experts] - padded[experts] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(0, capacity, block_m, device=dev), right=True)
    return sorted_pairs, block_expert.clamp_(max=num_experts - 1).to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, out_ptr, route_ptr,
    sorted_pairs_ptr, block_expert_ptr, padded_rows_ptr,
    pairs, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
    TOP_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ROWS_PER_PAIR: tl.constexpr, SWIGLU: tl.constexpr, ROUTED: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, n] for the BLOCK_M pairs of one expert and BLOCK_N columns:
    a[row] @ W[e]^T, with row = the pair's token (ROWS_PER_PAIR False) or the pair itself;
    SWIGLU: silu(a W^T) * (a W2^T); ROUTED: times the pair's routing weight."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < pairs
    row = pair if ROWS_PER_PAIR else pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_tile = e * stride_we + cols[None, :] * stride_wn
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        a = tl.load(a_ptr + row[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w_mask = (k[:, None] < K) & (cols[None, :] < N)
        w = tl.load(w_ptr + w_tile + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if FP8:  # one scale per (SCALE_N x SCALE_K) block; BLOCK_K divides SCALE_K, so within
            # a K tile the scale is one per column: it multiplies the tile's product (e4m3 -> bf16 is exact)
            s_off = e * stride_se + (cols // SCALE_N) * stride_sn + (kb * BLOCK_K // SCALE_K) * stride_sk
            acc += tl.dot(a.to(DOT), w.to(DOT)) * tl.load(s_ptr + s_off, mask=cols < N, other=0.0)[None, :]
        else:
            acc += tl.dot(a.to(DOT), w.to(DOT))
        if SWIGLU:
            w2 = tl.load(w2_ptr + w_tile + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            if FP8:
                acc2 += tl.dot(a.to(DOT), w2.to(DOT)) * tl.load(s2_ptr + s_off, mask=cols < N, other=0.0)[None, :]
            else:
                acc2 += tl.dot(a.to(DOT), w2.to(DOT))
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if ROUTED:
        acc *= tl.load(route_ptr + pair, mask=valid, other=0.0)[:, None]
    out = out_ptr + pair[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def block_rows(pairs: int, num_experts: int) -> int:
    """Rows (token, expert) pairs a block of one expert takes: few while decoding, where
    each expert sees a handful of rows and the weights' reading is all the work."""
    return 16 if pairs <= 8 * num_experts else 32 if pairs <= 32 * num_experts else 64


def tile_config(block_m: int, pairs: int, fp8: bool) -> dict:
    """Tile sizes and pipelining of one grouped GEMM. Swept on an H200 at V2-Lite's shapes
    inside CUDA graphs (64 experts, top 6, 2048 x 1408, 1 to 256 tokens, results/
    moe-tiles-h200.json): K tiles of 128 read the weights fastest in every case; at one
    token e4m3 wants 8 warps (gate/up and down 38 us a layer against 59 before)."""
    if block_m == 64:  # prefill: compute-bound; not swept
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    if fp8:
        return {"BLOCK_N": 64 if block_m == 16 else 128, "BLOCK_K": 128, "num_warps": 8 if pairs <= 16 else 4,
                "num_stages": 3}
    return {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4 if block_m == 16 else 3}


def _launch(a, w: Weight, out, aligned, pairs: int, top_k: int, block_m: int, *, w2: Weight | None = None,
            route: torch.Tensor | None = None, rows_per_pair: bool = False) -> None:
    sorted_pairs, block_expert, padded_rows = aligned
    fp8 = isinstance(w, Fp8Weight)
    q, scale = kernel_parts(w)
    q2, scale2 = kernel_parts(w2) if w2 is not None else (q, scale)
    _, n, k = q.shape
    config = tile_config(block_m, pairs, fp8)
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    scale_n, scale_k = scale_block(w)
    if scale_k % block_k:
        raise ValueError(f"fp8 block scales of {scale_k} columns: blocks of {block_k} must divide them")
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    dot = dot_dtype(a.dtype)
    _grouped_gemm[grid](
        a, q, q2, scale, scale2, out, route if route is not None else out,
        sorted_pairs, block_expert, padded_rows,
        pairs, n, k,
        a.stride(0), q.stride(0), q.stride(1), q.stride(2),
        *(scale.stride() if fp8 else (0, 0, 0)), out.stride(0),
        TOP_K=top_k, SCALE_N=scale_n, SCALE_K=scale_k, ROWS_PER_PAIR=rows_per_pair, SWIGLU=w2 is not None,
        ROUTED=route is not None, FP8=fp8, DOT=dot, BLOCK_M=block_m, **config,
    )


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Weight, up: Weight,
              down: Weight) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate x) * up x); x [T, D],
    ids and weights [T, k]; gate and up [E, I, D], down [E, D, I] (stack_experts)."""
    t, top_k = ids.shape
    pairs = t * top_k
    num_experts = (gate.q if isinstance(gate, Fp8Weight) else gate).shape[0]
    inner = (gate.q if isinstance(gate, Fp8Weight) else gate).shape[1]
    block_m = block_rows(pairs, num_experts)
    aligned = align_by_expert_triton(ids, num_experts, block_m)  # one launch; align_by_expert is its reference
    x = x.contiguous()
    h = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
    _launch(x, gate, h, aligned, pairs, top_k, block_m, w2=up)
    y = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
    route = weights.flatten().to(torch.float32).contiguous()
    _launch(h, down, y, aligned, pairs, top_k, block_m, route=route, rows_per_pair=True)
    return y.view(t, top_k, -1).sum(1)
