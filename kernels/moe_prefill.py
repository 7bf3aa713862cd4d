"""A prefill's routed experts with their operands brought by the Hopper's tensor memory
accelerator (TMA, Triton's tensor descriptors). `moe.moe_experts` is the reference;
`fused_moe.fused_moe` calls this where a step has thousands of (token, expert) pairs.

fused_moe's grouped GEMM gathers each block's rows of activations itself, row by row, and
reaches 350-450 TFLOP/s there, where a dense GEMM of the same size reaches ~780
(scripts/probe_grouped_mm.py). Here:

1. `gather_rows`: the pairs' rows of x copied once into expert order (the rows
   `align_by_expert` lays out: each expert's run padded to BLOCK_M, padding rows zero),
   so that every block of rows is one contiguous tile and TMA can bring it.
2. gate and up in one grouped GEMM, SwiGLU fused, h written in that same order; e4m3
   experts take e4m3 activations (x quantized per token and 128 columns, h written so).
3. down over h's rows in order, scaled by the pair's routing weight, written to the
   pair's row; the k rows of a token are then summed (moe_sum.py).

Programs run the N tiles of one block of rows one after another, so a block's rows and
its expert's weights are read from HBM about once and then from L2. An e4m3 tile of
weights is one of DeepSeek's 128 x 128 scale blocks: its product is scaled once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from preload.kernels.fp8 import FP8, FP8_MAX
from preload.kernels.fp8_act import GROUP, quantize_groups, round_e4m3
from preload.kernels.launch import launcher
from preload.kernels.moe_sum import sum_pairs
from preload.kernels.quant import Fp8Weight, Weight, kernel_parts, scale_block
from preload.kernels.triton_dot import dot_dtype

GATHER_ROWS = 32  # rows a gathering program copies


@triton.jit
def _gather_rows(src_ptr, dst_ptr, sorted_pairs_ptr, padded_rows_ptr, pairs, K, stride_src, stride_dst,
                 TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """dst[row] = src[token of the pair at row], zero for padding rows."""
    first = tl.program_id(0) * ROWS
    if first >= tl.load(padded_rows_ptr):
        return
    row = first + tl.arange(0, ROWS)
    pair = tl.load(sorted_pairs_ptr + row)
    token = (pair // TOP_K).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(src_ptr + token[:, None] * stride_src + k[None, :], mask=(pair < pairs)[:, None] & (k < K)[None, :],
                    other=0.0)
        tl.store(dst_ptr + row.to(tl.int64)[:, None] * stride_dst + k[None, :], v, mask=(k < K)[None, :])


def gather_rows(src: torch.Tensor, aligned, pairs: int, top_k: int) -> torch.Tensor:
    """The rows of src [T, K] in expert order: [capacity, K], row r the token of
    sorted_pairs[r] (zero where that is padding; rows past the rows in use unwritten)."""
    sorted_pairs, _, padded_rows = aligned
    k = src.shape[1]
    dst = torch.empty(sorted_pairs.numel(), k, dtype=src.dtype, device=src.device)
    block_k = min(triton.next_power_of_2(k), 256)
    launcher(_gather_rows)[(triton.cdiv(sorted_pairs.numel(), GATHER_ROWS),)](
        src, dst, sorted_pairs, padded_rows, pairs, k, src.stride(0), dst.stride(0),
        TOP_K=top_k, ROWS=GATHER_ROWS, BLOCK_K=block_k)
    return dst


@triton.jit
def _expert_gemm(
    a_desc, a_scale_ptr, w_desc, w2_desc, s_ptr, s2_ptr, out_ptr, out_scale_ptr, route_ptr,
    sorted_pairs_ptr, block_expert_ptr, padded_rows_ptr, pairs, N, K, n_tiles,
    stride_asm, stride_se, stride_sn, stride_om, stride_osm,
    SWIGLU: tl.constexpr, FP8: tl.constexpr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of a[rows] @ W[e]^T for the block's expert e.
    SWIGLU: silu(a W^T) * (a W2^T), written at the rows themselves (expert order);
    else times the pair's routing weight, written at the pair's row.
    FP8: a and W e4m3, a with a scale per row and BLOCK_K (== 128) columns, W per
    128 x 128 block (BLOCK_N == BLOCK_K == 128). OUT_FP8: out e4m3, a scale per row and
    BLOCK_N columns."""
    pid = tl.program_id(0)
    pid_m, pid_n = pid // n_tiles, pid % n_tiles  # (the N tiles of a block of rows run together)
    m0 = pid_m * BLOCK_M
    if m0 >= tl.load(padded_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    n0 = pid_n * BLOCK_N
    rows = m0 + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        a = a_desc.load([m0, k0]).to(DOT)
        w = w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).to(DOT)
        if FP8:  # the K tile's product on the fp8 tensor cores, scaled in float32 after
            scale = tl.load(a_scale_ptr + rows.to(tl.int64) * stride_asm + kb)[:, None]
            s_at = e.to(tl.int64) * stride_se + pid_n * stride_sn + kb
            acc += tl.dot(a, w.T) * (scale * tl.load(s_ptr + s_at))
            if SWIGLU:
                w2 = w2_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).to(DOT)
                acc2 += tl.dot(a, w2.T) * (scale * tl.load(s2_ptr + s_at))
        else:
            acc = tl.dot(a, w.T, acc)
            if SWIGLU:
                w2 = w2_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).to(DOT)
                acc2 = tl.dot(a, w2.T, acc2)
    cols = n0 + tl.arange(0, BLOCK_N)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
        out_row = rows.to(tl.int64)
        keep = rows >= 0
    else:
        pair = tl.load(sorted_pairs_ptr + rows)
        keep = pair < pairs
        acc *= tl.load(route_ptr + pair, mask=keep, other=0.0)[:, None]
        out_row = pair.to(tl.int64)
    if OUT_FP8:
        out_scale = tl.maximum(tl.max(tl.abs(acc), 1), 1e-12) / FP8_MAX
        acc = round_e4m3(tl.clamp(acc / out_scale[:, None], -FP8_MAX, FP8_MAX))
        tl.store(out_scale_ptr + out_row * stride_osm + pid_n, out_scale, mask=keep)
    tl.store(out_ptr + out_row[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=keep[:, None] & (cols < N)[None, :])


def tile_config(fp8: bool, swiglu: bool) -> dict:
    """Tiles and pipelining, swept on an H200 at V2-Lite's shapes, 2048 and 8192 tokens
    (scripts/probe_grouped_mm.py, results/kernels/moe-prefill-tma-h200.json): 8 warps
    (4: a third of the speed); bf16 K tiles of 64 (one 128-byte row of a TMA box), 4
    stages, down 256 columns wide; e4m3 tiles are a scale block, 128 x 128. A layer at
    2048 tokens: bf16 521 us (fused_moe's kernel 612), e4m3 498 (561)."""
    if fp8:
        return {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3 if swiglu else 4}
    return {"BLOCK_N": 128 if swiglu else 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}


def supported(gate: Weight, up: Weight, down: Weight, block_m: int) -> bool:
    """Whether these experts' prefill runs here: blocks of 64 or 128 rows; bf16, or e4m3
    with DeepSeek's 128 x 128 scale blocks (other scales: fused_moe's kernel; float32,
    whose tiles take twice the bytes, past the shared memory tile_config's stages are
    sized for: fused_moe's too); matrices that TMA can read (16-byte aligned, rows
    contiguous, every other stride a multiple of 16 bytes: any arena's, whose entries lie
    256 bytes apart, ipc/layout.py)."""
    if block_m not in (64, 128):
        return False
    if any(kernel_parts(w)[0].element_size() > 2 for w in (gate, up, down)):
        return False
    if isinstance(gate, Fp8Weight) and scale_block(gate) != (128, 128):
        return False
    return all(_tma_readable(kernel_parts(w)[0]) for w in (gate, up, down))


def _tma_readable(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def _weight_parts(w: Weight, block_n: int, block_k: int):
    q, scale = (w.q, w.scale_inv) if isinstance(w, Fp8Weight) else (w, None)
    desc = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_n, block_k])
    return desc, scale


def _launch(a: torch.Tensor, a_scale, w: Weight, out: torch.Tensor, aligned, pairs: int, block_m: int, *,
            w2: Weight | None = None, route: torch.Tensor | None = None, out_scale=None, config=None) -> None:
    sorted_pairs, block_expert, padded_rows = aligned
    fp8 = isinstance(w, Fp8Weight)
    config = config or tile_config(fp8, w2 is not None)
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    _, n, k = (w.q if fp8 else w).shape
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    w_desc, scale = _weight_parts(w, block_n, block_k)
    w2_desc, scale2 = _weight_parts(w2, block_n, block_k) if w2 is not None else (w_desc, scale)
    n_tiles = triton.cdiv(n, block_n)
    launcher(_expert_gemm)[(sorted_pairs.numel() // block_m * n_tiles,)](
        a_desc, a_scale if fp8 else out, w_desc, w2_desc, scale if fp8 else out, scale2 if fp8 else out, out,
        out_scale if out_scale is not None else out, route if route is not None else out,
        sorted_pairs, block_expert, padded_rows, pairs, n, k, n_tiles,
        a_scale.stride(0) if fp8 else 0, *(scale.stride()[:2] if fp8 else (0, 0)), out.stride(0),
        out_scale.stride(0) if out_scale is not None else 0,
        SWIGLU=w2 is not None, FP8=fp8, OUT_FP8=out_scale is not None, FP8_MAX=FP8_MAX,
        DOT=dot_dtype(a.dtype), BLOCK_M=block_m, **config,
    )


def moe_prefill(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Weight, up: Weight, down: Weight,
                aligned, block_m: int, configs: tuple[dict, dict] | None = None,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate x) * up x) (+ add), as
    fused_moe.fused_moe, for experts `supported` and the pairs `aligned` by
    align_by_expert_triton(ids, E, block_m). `configs`: (gate/up, down) tiles to use
    instead of tile_config's (the probe's sweep)."""
    t, top_k = ids.shape
    pairs = t * top_k
    fp8 = isinstance(gate, Fp8Weight)
    inner = (gate.q if fp8 else gate).shape[1]
    capacity = aligned[0].numel()
    route = weights.flatten().to(torch.float32).contiguous()
    y = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
    gate_up, down_cfg = configs or (None, None)
    if fp8:
        xq, x_scale = quantize_groups(x.contiguous())
        a, a_scale = gather_rows(xq.view(torch.uint8), aligned, pairs, top_k).view(FP8), \
            gather_rows(x_scale, aligned, pairs, top_k)
        h = torch.empty(capacity, inner, dtype=FP8, device=x.device)
        h_scale = torch.empty(capacity, triton.cdiv(inner, GROUP), dtype=torch.float32, device=x.device)
    else:
        a, a_scale = gather_rows(x, aligned, pairs, top_k), None
        h, h_scale = torch.empty(capacity, inner, dtype=x.dtype, device=x.device), None
    _launch(a, a_scale, gate, h, aligned, pairs, block_m, w2=up, out_scale=h_scale, config=gate_up)
    _launch(h, h_scale, down, y, aligned, pairs, block_m, route=route, config=down_cfg)
    return sum_pairs(y, top_k, add)
