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

from preload.kernels.fp8 import FP8, FP8_MAX
from preload.kernels.fp8_act import GROUP, quantize_groups, round_e4m3
from preload.kernels.launch import launcher
from preload.kernels.moe_align import align_by_expert_triton
from preload.kernels.moe_prefill import moe_prefill, supported
from preload.kernels.moe_sum import sum_pairs
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
    a_ptr, a_scale_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, out_ptr, out_scale_ptr, route_ptr,
    sorted_pairs_ptr, block_expert_ptr, padded_rows_ptr,
    pairs, N, K,
    stride_am, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om, stride_osm,
    TOP_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ROWS_PER_PAIR: tl.constexpr,
    SWIGLU: tl.constexpr, ROUTED: tl.constexpr, FP8: tl.constexpr, A_FP8: tl.constexpr, OUT_FP8: tl.constexpr,
    A_GROUP: tl.constexpr, FP8_MAX: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, n] for the BLOCK_M pairs of one expert and BLOCK_N columns:
    a[row] @ W[e]^T, with row = the pair's token (ROWS_PER_PAIR False) or the pair itself;
    SWIGLU: silu(a W^T) * (a W2^T); ROUTED: times the pair's routing weight.
    A_FP8: a is e4m3 with a scale per row and A_GROUP columns (fp8_act.py), and so is W
    (FP8): a K tile's product runs on the fp8 tensor cores and takes both scales after.
    OUT_FP8: out is e4m3 likewise, BLOCK_N (== A_GROUP) columns a scale: the next GEMM's A."""
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
            scale = tl.load(s_ptr + s_off, mask=cols < N, other=0.0)[None, :]
            if A_FP8:  # (BLOCK_K divides A_GROUP too: one activation scale per row in the tile)
                a_scale = tl.load(a_scale_ptr + row * stride_asm + kb * BLOCK_K // A_GROUP, mask=valid, other=0.0)
                scale = a_scale[:, None] * scale
            acc += tl.dot(a.to(DOT), w.to(DOT)) * scale
        else:
            acc += tl.dot(a.to(DOT), w.to(DOT))
        if SWIGLU:
            w2 = tl.load(w2_ptr + w_tile + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            if FP8:
                scale2 = tl.load(s2_ptr + s_off, mask=cols < N, other=0.0)[None, :]
                if A_FP8:
                    scale2 = a_scale[:, None] * scale2
                acc2 += tl.dot(a.to(DOT), w2.to(DOT)) * scale2
            else:
                acc2 += tl.dot(a.to(DOT), w2.to(DOT))
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if ROUTED:
        acc *= tl.load(route_ptr + pair, mask=valid, other=0.0)[:, None]
    if OUT_FP8:
        out_scale = tl.maximum(tl.max(tl.abs(acc), 1), 1e-12) / FP8_MAX
        acc = round_e4m3(tl.clamp(acc / out_scale[:, None], -FP8_MAX, FP8_MAX))
        tl.store(out_scale_ptr + pair * stride_osm + pid_n, out_scale, mask=valid)
    out = out_ptr + pair[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def block_rows(pairs: int, num_experts: int) -> int:
    """Rows (token, expert) pairs a block of one expert takes: few while decoding, where
    each expert sees a handful of rows and the weights' reading is all the work; 128 once
    experts average that many (a 2048-token step of V2-Lite: 192), where the product is
    the work (results/kernels/moe-prefill-tiles-h200.json)."""
    if pairs <= 8 * num_experts:
        return 16
    if pairs <= 32 * num_experts:
        return 32
    return 128 if pairs >= 128 * num_experts else 64


def fp8_activations(block_m: int) -> bool:
    """Whether e4m3 weights meet e4m3 activations (fp8_act.py) on the fp8 tensor cores:
    in a prefill's blocks of rows, where the product, not the weights' reading, is the
    work; a few rows read the weights and convert them in registers."""
    return block_m >= 64


def tile_config(block_m: int, pairs: int, fp8: bool, swiglu: bool = True, fp8_act: bool = False) -> dict:
    """Tile sizes and pipelining of one grouped GEMM. Swept on an H200 at V2-Lite's shapes
    inside CUDA graphs (64 experts, top 6, 2048 x 1408, 1 to 256 tokens, results/
    moe-tiles-h200.json): K tiles of 128 read the weights fastest in every case; at one
    token e4m3 wants 8 warps (gate/up and down 38 us a layer against 59 before). For a
    prefill (2048 and 8192 tokens, results/kernels/moe-prefill-tiles-h200.json) blocks of 128 rows
    with 8 warps: gate/up 407 and 511 TFLOP/s, down 325 and 391 (230 and 224 with the
    64 x 64 tiles before). With fp8 activations a K tile is one scale group (128), and
    blocks of 64 rows with 8 warps (gate/up 412 and 474, down 432 and 446; blocks of 128
    rows 155 and 201 for gate/up: results/kernels/moe-prefill-act-tiles-h200.json)."""
    if fp8_act:
        return {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    if block_m == 128:
        return {"BLOCK_N": 128 if swiglu else 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    if block_m == 64:
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    if fp8:
        return {"BLOCK_N": 64 if block_m == 16 else 128, "BLOCK_K": 128, "num_warps": 8 if pairs <= 16 else 4,
                "num_stages": 3}
    return {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4 if block_m == 16 else 3}


def _launch(a, w: Weight, out, aligned, pairs: int, top_k: int, block_m: int, *, w2: Weight | None = None,
            route: torch.Tensor | None = None, rows_per_pair: bool = False, a_scale: torch.Tensor | None = None,
            out_scale: torch.Tensor | None = None) -> None:
    """One grouped GEMM (see _grouped_gemm); `a_scale`: a is e4m3 with these scales (and w
    must be e4m3 too); `out_scale`: out is written in e4m3 with these scales."""
    sorted_pairs, block_expert, padded_rows = aligned
    fp8 = isinstance(w, Fp8Weight)
    q, scale = kernel_parts(w)
    q2, scale2 = kernel_parts(w2) if w2 is not None else (q, scale)
    _, n, k = q.shape
    fp8_act = a_scale is not None
    if fp8_act and not fp8:
        raise ValueError("e4m3 activations need e4m3 weights")
    config = tile_config(block_m, pairs, fp8, w2 is not None, fp8_act)
    if a.element_size() == 4:  # float32 operands: the tiles, sized for 2-byte ones, would not fit
        # in shared memory (blocks of 128 rows asked for 294,912 bytes of an H100's 232,448).
        config = config | {"BLOCK_K": config["BLOCK_K"] // 2}
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    scale_n, scale_k = scale_block(w)
    if scale_k % block_k:
        raise ValueError(f"fp8 block scales of {scale_k} columns: blocks of {block_k} must divide them")
    if out_scale is not None and block_n != GROUP:
        raise ValueError(f"e4m3 outputs take a scale per {GROUP} columns: tiles of {block_n} columns cannot")
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    launcher(_grouped_gemm)[grid](
        a, a_scale if fp8_act else a, q, q2, scale, scale2, out, out_scale if out_scale is not None else out,
        route if route is not None else out, sorted_pairs, block_expert, padded_rows,
        pairs, n, k,
        a.stride(0), a_scale.stride(0) if fp8_act else 0, q.stride(0), q.stride(1), q.stride(2),
        *(scale.stride() if fp8 else (0, 0, 0)), out.stride(0), out_scale.stride(0) if out_scale is not None else 0,
        TOP_K=top_k, SCALE_N=scale_n, SCALE_K=scale_k, ROWS_PER_PAIR=rows_per_pair, SWIGLU=w2 is not None,
        ROUTED=route is not None, FP8=fp8, A_FP8=fp8_act, OUT_FP8=out_scale is not None, A_GROUP=GROUP,
        FP8_MAX=FP8_MAX, DOT=dot_dtype(a.dtype), BLOCK_M=block_m, **config,
    )


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Weight, up: Weight,
              down: Weight, add: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate x) * up x), plus `add`
    [T, D] if given (the shared experts' output: moe_sum.py adds it in the same pass); x
    [T, D], ids and weights [T, k]; gate and up [E, I, D], down [E, D, I] (stack_experts).
    e4m3 experts in a prefill take e4m3 activations (fp8_activations): x quantized per token
    and 128 columns, and the SwiGLU output written so by the first GEMM for the second.
    Where experts average 128 pairs or more, moe_prefill.py's kernels (TMA) run instead."""
    t, top_k = ids.shape
    pairs = t * top_k
    num_experts, inner = (gate.q if isinstance(gate, Fp8Weight) else gate).shape[:2]
    block_m = block_rows(pairs, num_experts)
    if block_m == 128 and supported(gate, up, down, block_m):  # a prefill's thousands of pairs: operands by TMA
        return moe_prefill(x, ids, weights, gate, up, down, align_by_expert_triton(ids, num_experts, block_m), block_m,
                           add=add)
    if isinstance(gate, Fp8Weight):  # (e4m3's prefill tiles: 64 rows, tile_config)
        block_m = min(block_m, 64)
    aligned = align_by_expert_triton(ids, num_experts, block_m)  # one launch; align_by_expert is its reference
    x = x.contiguous()
    route = weights.flatten().to(torch.float32).contiguous()
    y = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
    if isinstance(gate, Fp8Weight) and fp8_activations(block_m):
        xq, x_scale = quantize_groups(x)
        h = torch.empty(pairs, inner, dtype=FP8, device=x.device)
        h_scale = torch.empty(pairs, triton.cdiv(inner, GROUP), dtype=torch.float32, device=x.device)
        _launch(xq, gate, h, aligned, pairs, top_k, block_m, w2=up, a_scale=x_scale, out_scale=h_scale)
        _launch(h, down, y, aligned, pairs, top_k, block_m, route=route, rows_per_pair=True, a_scale=h_scale)
    else:
        h = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
        _launch(x, gate, h, aligned, pairs, top_k, block_m, w2=up)
        _launch(h, down, y, aligned, pairs, top_k, block_m, route=route, rows_per_pair=True)
    return sum_pairs(y, top_k, add)
