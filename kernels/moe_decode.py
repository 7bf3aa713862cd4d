"""The MoE layer of a decode step in two launches (Triton): a few tokens, each times its
k routed experts and the shared experts, summed. `moe.moe_experts` plus the shared MLP is
the reference it is tested against; fused_moe.py takes larger batches.

With one or two tokens a layer's work is reading k + 1 experts' matrices once, and the
grouped GEMM of fused_moe.py does that at about a quarter of the HBM's speed: its tiles
of 16 rows hold one real row, each program walks all of K alone, and around it the layer
spends five more launches (aligning pairs by expert, the shared experts' two projections,
the sum over k, adding the shared output). Here:

1. gate/up: one program per (token, slot, block of columns, slice of K), a slot being one
   of the token's k experts or the shared experts. It multiplies the slot's gate and up
   matrices by the token's row on the CUDA cores (no padding to a tensor-core tile), in
   float32, over its K slice; the slices meet as in split_k.py (the last to arrive sums
   them in order) and the last writes h = silu(x G^T) * (x U^T) for the slot.
2. down: one program per (token, block of output columns, slot and K slice); each slot's
   h times its down matrix, scaled by its routing weight (the shared experts' is 1); the
   last to arrive sums every slot and slice in order and writes the token's MoE output.

Weights are read in their stored form, bf16 or e4m3 with block scales (a per-tensor
scale is one block), dequantized in registers; fixed summation orders make a replayed
CUDA graph give what the eager step gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher
from preload.kernels.quant import Fp8Weight, Weight, kernel_parts, scale_block
from preload.kernels.split_k import combine_splits, counters, partials, row_dot

# Tokens up to which a step's MoE takes this path, by whether the weights are e4m3: each
# token's slots re-read their experts' matrices, so past a few tokens the grouped GEMMs,
# which read each expert once, win (H200, V2-Lite: 4 tokens 76 us vs 96 in e4m3, 126 vs
# 116 in bf16; results/kernels/moe-decode-h200.json).
MAX_TOKENS = {False: 2, True: 4}
BLOCK_K = 128  # one scale block's width: a K tile never straddles two scales


@triton.jit
def _gate_up(
    x_ptr, ids_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, sg_ptr, su_ptr, sgs_ptr, sus_ptr, part_ptr, counter_ptr, h_ptr,
    N, N_SHARED, K, tiles_per_split,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_shn, stride_ssn, stride_ssk,
    stride_ps, stride_pm, stride_hm,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
):
    """h[token, slot, cols] = silu(x G^T) * (x U^T) for the slot's expert (slot < TOP_K:
    the token's routed choice; slot TOP_K: the shared experts), over this program's K
    slice, combined with the other slices."""
    ts, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token, slot = ts // SLOTS, ts % SLOTS
    # The slot's matrices picked with selects, not branches: what the compiler knows of
    # both strides (multiples of 16: vector loads) holds for the pick.
    routed = slot < TOP_K
    e = tl.load(ids_ptr + token * TOP_K + slot, mask=routed, other=0).to(tl.int64)
    g, u = tl.where(routed, g_ptr + e * stride_we, sg_ptr), tl.where(routed, u_ptr + e * stride_we, su_ptr)
    gs, us = tl.where(routed, gs_ptr + e * stride_se, sgs_ptr), tl.where(routed, us_ptr + e * stride_se, sus_ptr)
    n, stride_n = tl.where(routed, N, N_SHARED), tl.where(routed, stride_wn, stride_shn)
    stride_s_n, stride_s_k = tl.where(routed, stride_sn, stride_ssn), tl.where(routed, stride_sk, stride_ssk)
    if pid_n * BLOCK_N >= n:  # the routed experts are narrower than the shared ones
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * tiles_per_split
    end = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    row = x_ptr + token * stride_xm
    acc = row_dot(row, g, gs, cols, n, K, first, end, stride_n, stride_s_n, stride_s_k, FP8, SCALE_N, SCALE_K,
                   BLOCK_N, BLOCK_K, SUB)
    acc2 = row_dot(row, u, us, cols, n, K, first, end, stride_n, stride_s_n, stride_s_k, FP8, SCALE_N, SCALE_K,
                    BLOCK_N, BLOCK_K, SUB)
    mask = cols < n
    out, last = combine_splits(acc, acc2, part_ptr, ts * stride_pm + cols, mask,
                               counter_ptr + ts * tl.num_programs(1) + pid_n, split, stride_ps, SPLITS, True)
    if last:
        tl.store(h_ptr + ts * stride_hm + cols, out.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down(
    h_ptr, ids_ptr, route_ptr, d_ptr, ds_ptr, sd_ptr, sds_ptr, part_ptr, counter_ptr, out_ptr,
    N, K, K_SHARED, splits_per_slot,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_shn, stride_ssn, stride_ssk,
    stride_ps, stride_pm, stride_om,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
):
    """out[token, cols] = sum over slots of weight * h[token, slot] D^T, the slot's and K
    slice's part here, every part summed in order by the last to arrive."""
    token, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, split = part // splits_per_slot, part % splits_per_slot
    routed = slot < TOP_K  # (selects, not branches, as in _gate_up)
    e = tl.load(ids_ptr + token * TOP_K + slot, mask=routed, other=0).to(tl.int64)
    d, ds = tl.where(routed, d_ptr + e * stride_we, sd_ptr), tl.where(routed, ds_ptr + e * stride_se, sds_ptr)
    k, stride_n = tl.where(routed, K, K_SHARED), tl.where(routed, stride_wn, stride_shn)
    stride_s_n, stride_s_k = tl.where(routed, stride_sn, stride_ssn), tl.where(routed, stride_sk, stride_ssk)
    weight = tl.load(route_ptr + token * TOP_K + slot, mask=routed, other=1.0)  # the shared experts': 1
    tiles = tl.cdiv(k, BLOCK_K)
    per = tl.cdiv(tiles, splits_per_slot)
    first = split * per
    end = tl.minimum(first + per, tiles)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = row_dot(h_ptr + (token * SLOTS + slot) * stride_hm, d, ds, cols, N, k, first, end, stride_n, stride_s_n,
                   stride_s_k, FP8, SCALE_N, SCALE_K, BLOCK_N, BLOCK_K, SUB) * weight
    mask = cols < N
    out, last = combine_splits(acc, acc, part_ptr, token * stride_pm + cols, mask,
                               counter_ptr + token * tl.num_programs(1) + pid_n, part, stride_ps, SPLITS, False)
    if last:
        tl.store(out_ptr + token * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_strides(w: Weight) -> tuple[int, ...]:
    return w.scale_inv.stride() if isinstance(w, Fp8Weight) else (0,) * (w.dim())


def fits(tokens: int, gate: Weight, up: Weight, down: Weight, shared: tuple[Weight, Weight, Weight] | None) -> bool:
    """Whether this path takes `tokens` tokens (MAX_TOKENS) with the routed experts (stacked
    [E, ...]) and the shared ones: all bf16, or all e4m3 with the same scale blocks; K
    contiguous; gate and up (routed, and shared) laid out alike, as one set of strides serves both."""
    ws = [gate, up, down, *(shared or ())]
    fp8 = [isinstance(w, Fp8Weight) for w in ws]
    if tokens > MAX_TOKENS[all(fp8)] or (any(fp8) and not all(fp8)):
        return False
    if all(fp8) and len({scale_block(w) for w in ws}) > 1:
        return False
    alike = [(gate, up)] + ([shared[:2]] if shared else [])
    if any(kernel_parts(a)[0].stride() != kernel_parts(b)[0].stride() or _scale_strides(a) != _scale_strides(b) for a, b in alike):
        return False
    return all(kernel_parts(w)[0].stride(-1) == 1 for w in ws)


def tile_config(tokens: int, fp8: bool) -> dict:
    """Columns per program, K slices per slot, K tiles per iteration and warps. Swept on an
    H200 at V2-Lite's shapes inside CUDA graphs (`scripts/sweep_kernels.py --moe-decode`,
    results/kernels/moe-decode-h200.json). e4m3 rows are half as many bytes: wider blocks of
    columns keep as many in flight; one token has fewer programs, so more K slices."""
    if fp8:
        return {"block_n": 64, "splits": 4 if tokens == 1 else 2, "sub": 4, "num_warps": 4}
    return {"block_n": 16, "splits": 2, "sub": 2, "num_warps": 4}


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Weight, up: Weight, down: Weight,
               shared: tuple[Weight, Weight, Weight] | None, config: dict | None = None) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate x) * up x), plus the
    shared experts' output; x [T, D], ids and weights [T, k]; gate and up [E, I, D], down
    [E, D, I] (fused_moe.stack_experts); shared: (gate, up, down) of the shared experts.
    `config`: tile_config's keys, to override it. Check `fits` first."""
    t, top_k = ids.shape
    fp8 = isinstance(gate, Fp8Weight)
    config = tile_config(t, fp8) | (config or {})
    block_n, splits = config["block_n"], config["splits"]
    launch = {"SUB": config["sub"], "num_warps": config["num_warps"], "num_stages": 1}
    slots = top_k + (shared is not None)
    (g, gs), (u, us), (d, ds) = kernel_parts(gate), kernel_parts(up), kernel_parts(down)
    sg, su, sd = shared if shared is not None else (gate, up, down)  # unread without shared experts
    (sgq, sgs), (suq, sus), (sdq, sds) = kernel_parts(sg), kernel_parts(su), kernel_parts(sd)
    scale_n, scale_k = scale_block(gate)
    if scale_k % BLOCK_K:
        raise ValueError(f"fp8 block scales of {scale_k} columns: K tiles of {BLOCK_K} must divide them")
    num, inner, dim = g.shape
    inner_shared = sgq.shape[-2] if shared is not None else 0
    x, ids = x.contiguous(), ids.contiguous()
    route = weights.to(torch.float32).contiguous()
    width = max(inner, inner_shared)
    h = torch.empty(t * slots, width, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(width, block_n)
    tiles = triton.cdiv(dim, BLOCK_K)
    per = triton.cdiv(tiles, splits)
    gate_splits = triton.cdiv(tiles, per)
    count = counters(x.device)
    part = partials(gate_splits, True, (t * slots, width), x.device)
    launcher(_gate_up)[(t * slots, blocks, gate_splits)](
        x, ids, g, u, gs, us, sgq, suq, sgs, sus, part, count, h,
        inner, inner_shared, dim, per,
        x.stride(0), g.stride(0), g.stride(1), *_scale_strides(gate), sgq.stride(-2), *_scale_strides(sg)[-2:],
        part.stride(0), part.stride(1), h.stride(0),
        TOP_K=top_k, SLOTS=slots, SPLITS=gate_splits, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, **launch,
    )
    out = torch.empty(t, dim, dtype=x.dtype, device=x.device)
    down_splits = min(splits, triton.cdiv(min(inner, inner_shared or inner), BLOCK_K))  # no slot's slice empty
    part = partials(slots * down_splits, False, (t, dim), x.device)
    launcher(_down)[(t, triton.cdiv(dim, block_n), slots * down_splits)](
        h, ids, route, d, ds, sdq, sds, part, count, out,
        dim, inner, inner_shared, down_splits,
        h.stride(0), d.stride(0), d.stride(1), *_scale_strides(down), sdq.stride(-2), *_scale_strides(sd)[-2:],
        part.stride(0), part.stride(1), out.stride(0),
        TOP_K=top_k, SLOTS=slots, SPLITS=slots * down_splits, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_N=block_n, BLOCK_K=BLOCK_K, **launch,
    )
    return out
