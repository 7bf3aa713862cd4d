"""The fp8 linear layer on the GPU: x @ W^T for an e4m3 matrix with its scales (128x128
blocks, or one for the tensor), dequantized in registers, never in memory. The
reference is `linear.linear` off the GPU (dequantize the matrix, then multiply).

A decode step multiplies a few rows by each dense matrix of the model (attention's
projections, the shared experts, the first layers' MLPs): for few rows (`GEMV_ROWS`)
the product is split over K as well (split_k.py), in one launch; for one row
(`ROW_DOT_ROWS`) on the CUDA cores (split_k.row_dot), not padded to a tensor-core tile.
With a second matrix (`fp8_swiglu`) it computes silu(x G^T) * (x U^T), a feed-forward layer's gate and up
projections, in that same launch. More rows go through the grouped GEMM of fused_moe.py
with one expert; a prefill's rows in e4m3 too (fp8_act.py), on the fp8 tensor cores:
where torch and the GPU offer it (Hopper), through cuBLASLt's block-scaled fp8 GEMM, which
takes DeepSeek's scales as they are (activations per row and 128 columns, weights per
128 x 128 block) and promotes each K tile's product into float32 as DeepGEMM does
(scripts/probe_scaled_mm.py on an H100, results/kernels/probe-scaled-mm-h100.json: V2-Lite's
dense matrices at 2,048 rows 1.5-1.9x as fast as the Triton kernel below, V3's 1.6-2.4x,
quantizing the rows included).

Within a K tile of 128 columns a block's scale is one number per output column, so it
multiplies the tile's dot product, not each weight: e4m3 converts to bf16 exactly.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from preload.kernels.fp8_act import quantize_groups
from preload.kernels.fused_moe import _launch, fp8_activations
from preload.kernels.launch import launcher
from preload.kernels.quant import Fp8Weight, scale_block
from preload.kernels.split_k import combine_splits, counters, partials, row_dot, slices
from preload.kernels.triton_dot import dot_dtype

log = logging.getLogger(__name__)

GEMV_ROWS = 16  # rows up to which the split-K kernel runs (its tile has 16 rows)
ROW_DOT_ROWS = 1  # rows up to which each row is its own program, on the CUDA cores (_row_gemv; at 2 the tile of 16 was faster)
ROW_BLOCK_N = 64  # _row_gemv's columns per program (as moe_decode's e4m3 tiles: half the bytes of bf16 rows)
BLOCK_K = 128  # one scale block's width: a K tile never straddles two scales


@triton.jit
def _partial(x_ptr, q_ptr, s_ptr, rows, cols, T, N, K, first, end, stride_xm, stride_qn, stride_qk, stride_sn,
             stride_sk, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over K tiles first..end-1 of x[rows] . (Q[cols] * scale), in float32."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, end):
        k = kb * BLOCK_K + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < T) & (k[None, :] < K), other=0.0)
        w = tl.load(q_ptr + cols[None, :] * stride_qn + k[:, None] * stride_qk,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        scale = tl.load(s_ptr + (cols // SCALE_N) * stride_sn + (kb * BLOCK_K // SCALE_K) * stride_sk, mask=cols < N, other=0.0)
        acc += tl.dot(a.to(DOT), w.to(DOT)) * scale[None, :]
    return acc


@triton.jit
def _split_k_gemv(
    x_ptr, q_ptr, s_ptr, q2_ptr, s2_ptr, part_ptr, counter_ptr, out_ptr,
    T, N, K, tiles_per_split,
    stride_xm, stride_qn, stride_qk, stride_sn, stride_sk, stride_ps, stride_pm, stride_om,
    SPLITS: tl.constexpr, SWIGLU: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = x[m] . W[n] (SWIGLU: silu(x[m] . W[n]) * (x[m] . W2[n])) over this
    program's slice of K, combined with the other slices (split_k.combine_splits)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * tiles_per_split
    end = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = _partial(x_ptr, q_ptr, s_ptr, rows, cols, T, N, K, first, end, stride_xm, stride_qn, stride_qk, stride_sn,
                   stride_sk, SCALE_N, SCALE_K, DOT, BLOCK_M, BLOCK_N, BLOCK_K)
    if SWIGLU:
        acc2 = _partial(x_ptr, q2_ptr, s2_ptr, rows, cols, T, N, K, first, end, stride_xm, stride_qn, stride_qk,
                        stride_sn, stride_sk, SCALE_N, SCALE_K, DOT, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rows[:, None] < T) & (cols[None, :] < N)
    out, last = combine_splits(acc, acc2 if SWIGLU else acc, part_ptr, rows[:, None] * stride_pm + cols[None, :], mask,
                               counter_ptr + pid_n, split, stride_ps, SPLITS, SWIGLU)
    if last:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_gemv(
    x_ptr, q_ptr, s_ptr, q2_ptr, s2_ptr, part_ptr, counter_ptr, out_ptr,
    N, K, tiles_per_split, stride_xm, stride_qn, stride_sn, stride_sk, stride_ps, stride_pm, stride_om,
    SPLITS: tl.constexpr, SWIGLU: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
):
    """_split_k_gemv for one row per program (split_k.row_dot): no padding to 16 rows."""
    row, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * tiles_per_split
    end = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    x = x_ptr + row * stride_xm
    acc = row_dot(x, q_ptr, s_ptr, cols, N, K, first, end, stride_qn, stride_sn, stride_sk, True, SCALE_N, SCALE_K,
                  BLOCK_N, BLOCK_K, SUB)
    acc2 = acc
    if SWIGLU:
        acc2 = row_dot(x, q2_ptr, s2_ptr, cols, N, K, first, end, stride_qn, stride_sn, stride_sk, True, SCALE_N,
                       SCALE_K, BLOCK_N, BLOCK_K, SUB)
    mask = cols < N
    out, last = combine_splits(acc, acc2, part_ptr, row * stride_pm + cols, mask,
                               counter_ptr + row * tl.num_programs(1) + pid_n, split, stride_ps, SPLITS, SWIGLU)
    if last:
        tl.store(out_ptr + row * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_gemv(rows: torch.Tensor, w: Fp8Weight, w2: Fp8Weight | None = None, block_n: int | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """rows [t <= GEMV_ROWS, K] @ W^T (with w2: silu(rows W^T) * (rows W2^T)) in the rows'
    dtype. Up to ROW_DOT_ROWS rows (and K contiguous), a program per row on the CUDA
    cores, in blocks of ROW_BLOCK_N columns; more, the tensor-core tile of 16 rows, in
    blocks of 32 (the fastest at V2-Lite's shapes on an H200: scripts/sweep_kernels.py
    --dense). `splits`: slices of the reduction (default: enough programs to fill the GPU
    twice over, at least one K tile each)."""
    t, k = rows.shape
    n = w.q.shape[0]
    by_row = t <= ROW_DOT_ROWS and w.q.stride(1) == 1
    block_n = block_n or (ROW_BLOCK_N if by_row else 32)
    blocks_n = triton.cdiv(n, block_n)
    splits, per = slices(triton.cdiv(k, BLOCK_K), (t if by_row else 1) * blocks_n, rows.device, splits)
    scale_n, scale_k = scale_block(w)
    if scale_k % BLOCK_K:
        raise ValueError(f"fp8 block scales of {scale_k} columns: K tiles of {BLOCK_K} must divide them")
    out = torch.empty(t, n, dtype=rows.dtype, device=rows.device)
    part = partials(splits, w2 is not None, (t, n), rows.device)
    second = w2 if w2 is not None else w
    if by_row:
        launcher(_row_gemv)[(t, blocks_n, splits)](
            rows, w.q, w.scale_inv, second.q, second.scale_inv, part, counters(rows.device), out, n, k, per,
            rows.stride(0), w.q.stride(0), w.scale_inv.stride(0), w.scale_inv.stride(1),
            part.stride(0), part.stride(1), out.stride(0),
            SPLITS=splits, SWIGLU=w2 is not None, SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
            SUB=min(4, triton.next_power_of_2(per)), num_warps=4, num_stages=1,
        )
        return out
    launcher(_split_k_gemv)[(blocks_n, splits)](
        rows, w.q, w.scale_inv, second.q, second.scale_inv, part, counters(rows.device), out, t, n, k, per,
        rows.stride(0), w.q.stride(0), w.q.stride(1), w.scale_inv.stride(0), w.scale_inv.stride(1),
        part.stride(0), part.stride(1), out.stride(0),
        SPLITS=splits, SWIGLU=w2 is not None, SCALE_N=scale_n, SCALE_K=scale_k, DOT=dot_dtype(rows.dtype),
        BLOCK_M=GEMV_ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4,
    )
    return out


def fp8_swiglu(x: torch.Tensor, gate: Fp8Weight, up: Fp8Weight) -> torch.Tensor | None:
    """silu(x G^T) * (x U^T) in one launch for a few rows; None for more (the caller
    then takes the two projections one by one)."""
    rows = x.reshape(-1, x.shape[-1])
    same_form = (gate.q.shape, gate.q.stride(), gate.scale_inv.stride(), gate.block) == \
        (up.q.shape, up.q.stride(), up.scale_inv.stride(), up.block)
    if rows.shape[0] > GEMV_ROWS or not same_form:
        return None
    return split_k_gemv(rows.contiguous(), gate, up).view(*x.shape[:-1], gate.q.shape[0])


@functools.cache
def block_scaled_gemm(device: torch.device) -> bool:
    """Whether `device` runs cuBLASLt's block-scaled fp8 GEMM through torch (F.scaled_mm
    with 1x128 and 128x128 scales: Hopper, torch 2.10 and later)."""
    return device.type == "cuda" and hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device) == (9, 0)


def takes_block_scales(w: Fp8Weight) -> bool:
    """Whether cuBLASLt takes `w` as it lies: 128 x 128 scales, one per block, row-major;
    the matrix's rows contiguous, its dimensions multiples of 16 (its TMA's alignment)."""
    n, k = w.q.shape
    return (w.block == (128, 128) and w.scale_inv.shape == (triton.cdiv(n, 128), triton.cdiv(k, 128))
            and w.scale_inv.is_contiguous() and w.q.stride(1) == 1 and w.q.stride(0) % 16 == 0
            and n % 16 == 0 and k % 16 == 0)


def padded_rows(t: int) -> int:
    """The rows cuBLASLt is given for t: a multiple of 16 (it refused 301 rows on the H200,
    CUBLAS_STATUS_NOT_SUPPORTED: their scales' column would not be 16-byte aligned; a
    graph's buckets are multiples of 16 already)."""
    return t + -t % 16


def block_scaled_linear(rows: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """rows [T, K] (bf16) @ W^T through cuBLASLt: the rows quantized per 128 columns
    (fp8_act.py, the scales by column as it reads them), then one block-scaled fp8 GEMM."""
    from torch.nn.functional import ScalingType, SwizzleType

    t = rows.shape[0]
    if padded_rows(t) != t:
        rows = F.pad(rows, (0, 0, 0, padded_rows(t) - t))
    q, scales = quantize_groups(rows, scales_by_column=True)
    w_scales = w.scale_inv
    if w_scales.shape[1] % 4:  # torch takes a row of K blocks' scales padded to a multiple of 4 (never read;
        w_scales = F.pad(w_scales, (0, -w_scales.shape[1] % 4), value=1.0)  # torch._scaled_mm misreads them unpadded)
    return F.scaled_mm(q, w.q.t(), scales, ScalingType.BlockWise1x128, w_scales.t(), ScalingType.BlockWise128x128,
                       SwizzleType.NO_SWIZZLE, SwizzleType.NO_SWIZZLE, None, rows.dtype)[:t]


REFUSED: set[tuple[int, int, int]] = set()  # (rows padded to 16, N, K) that cuBLASLt would not run here


def cublaslt_or_none(rows: torch.Tensor, w: Fp8Weight) -> torch.Tensor | None:
    """block_scaled_linear, or None for a shape cuBLASLt refuses on this GPU and library
    (CUBLAS_STATUS_NOT_SUPPORTED, from its heuristics, before any launch: on the H200 it
    refused 7168 x 2048 at 301 rows before the rows were padded to 16, where the H100 ran
    it): that shape then takes the Triton GEMM for good, said once in the log. A graph's
    step runs once eagerly before its capture (both kinds), so a refusal is met outside it."""
    key = (padded_rows(rows.shape[0]), *w.q.shape)
    if key in REFUSED:
        return None
    try:
        return block_scaled_linear(rows, w)
    except RuntimeError as e:
        if "NOT_SUPPORTED" not in str(e):
            raise
        REFUSED.add(key)
        log.warning("cuBLASLt's block-scaled fp8 GEMM refused %d rows x %s here (%s); the Triton GEMM takes it",
                    key[0], tuple(w.q.shape), str(e).splitlines()[0][:200])
        return None


def one_expert_block(t: int) -> int:
    """The grouped GEMM's rows a block for `t` rows through it with one expert: each block
    re-reads the matrix (from L2, mostly)."""
    return 16 if t <= 64 else 32 if t <= 256 else 64


def one_expert_layout(t: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped GEMM's alignment (moe_align's form) for `t` rows and one expert, every row
    its own pair, padded to whole blocks of `block_m` (index t: no pair)."""
    capacity = triton.cdiv(t, block_m) * block_m
    pairs = torch.arange(capacity, dtype=torch.int32, device=device).clamp_(max=t)
    # (torch.full, not torch.tensor: no copy from the host, which would wait for the device)
    return (pairs, torch.zeros(capacity // block_m, dtype=torch.int32, device=device),
            torch.full((1,), capacity, dtype=torch.int32, device=device))


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x @ W^T for an e4m3 matrix with its scales: split-K for a few rows; for a
    prefill's rows cuBLASLt's block-scaled GEMM where it runs, else the grouped GEMM with
    one expert and every row its own pair."""
    shape, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    t, n = rows.shape[0], w.q.shape[0]
    if t <= GEMV_ROWS:
        return split_k_gemv(rows, w).view(*shape, n)
    block_m = one_expert_block(t)
    if fp8_activations(block_m) and block_scaled_gemm(x.device) and takes_block_scales(w):
        out = cublaslt_or_none(rows, w)
        if out is not None:
            return out.view(*shape, n)
    aligned = one_expert_layout(t, block_m, x.device)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    one = Fp8Weight(w.q[None], w.scale_inv[None], w.block)
    if fp8_activations(block_m):  # a prefill's rows: e4m3 on the fp8 tensor cores
        q, scales = quantize_groups(rows)
        _launch(q, one, out, aligned, t, 1, block_m, rows_per_pair=True, a_scale=scales)
    else:
        _launch(rows, one, out, aligned, t, 1, block_m, rows_per_pair=True)
    return out.view(*shape, n)
