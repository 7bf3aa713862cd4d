"""MLA prefill on the GPU (Triton): flash attention of a step's new tokens against their
contexts in the paged latent cache, one chunk of context at a time. prefill.py explains
the chunking and holds the torch form it is tested against (`mla_prefill_reference`).

For each chunk of the flat context order, torch gathers and dequantizes the chunk's
latents and up-projects them to keys and values (one GEMM, into one buffer reused by
every chunk); then `_prefill_chunk` runs every query of the batch against the chunk's
keys of its own sequence, their tiles brought by the Hopper's tensor memory accelerator
(TMA: Triton's tensor descriptors; 8-10% faster than pointer loads). A program takes
BLOCK_M consecutive new tokens of one sequence and one head (the expanded form's keys
differ per head, so heads do not share tiles); the query-key dot is two dots, q_nope .
k_nope + q_pe . k_pe, since dn + dr (192) is no power of two. Only key tiles at or before
the tile's last query position are visited; those wholly before its first query skip the
causal mask (by absolute position in the sequence), which only the tiles on the diagonal
need. The softmax runs in base 2.

The online softmax state (running max, sum, weighted values; float32) lives in buffers
between chunks. A program whose sequence begins in this chunk starts it fresh: every
query sees position 0, so a sequence begun in an earlier chunk has state in every row.
One with no keys in the chunk touches nothing, except in the last chunk's launch, where
every program divides its rows out into `out`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from preload.kernels.launch import launcher
from preload.kernels.prefill import CHUNK, PrefillPlan, chunk_latents, prefill_plan
from preload.kernels.triton_dot import INTERPRETING, dot_dtype

# Tiles on the GPU: 128 new tokens x 64 keys, 8 warps, 3 stages: the fastest of those
# timed on an H200 (a 16k prompt, V2-Lite: 413 TFLOP/s against 358 for 64 x 64, 4
# warps, 2 stages; 325 for 128 x 32), and with the keys brought by TMA on an H100 the
# fastest or within 10% at every prompt step's shape swept (2,048 x 1 85.6 us a layer
# against 95.0 by pointer loads, 8 x 256 34.5 against 38.4;
# scripts/probe_prefill_attention.py, results/kernels/prefill-attention-tma-h100.json).
# In the interpreter the smallest tiles a dot takes, so that the tests' small cases span
# several tiles, and numpy gets through them faster.
BLOCK_M = 16 if INTERPRETING else 128  # new tokens per program
BLOCK_N = 16 if INTERPRETING else 64  # keys per step of its loop
NUM_WARPS = 8
NUM_STAGES = 3
LOG2_E = 1.4426950408889634  # the softmax in base 2: exp2 is the hardware's


@triton.jit
def _attend(m, l, acc, q_nope, q_pe, kn_desc, kp_desc, v_desc, start, lo, k0, k_hi, q_pos, head, qk_scale,
            V_COL: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """BLOCK_N keys from flat index `start` into the running softmax (in base 2). Without
    CAUSAL every row sees every key of the tile: it lies below the diagonal, inside the range.
    The tiles come by TMA; rows past the chunk's end come as zeros, and any other row the
    tile holds beyond k_hi (the next sequence's) is masked out of the scores."""
    key = start + tl.arange(0, BLOCK_N)
    row = (start - lo).to(tl.int32)  # the tile's first row in the chunk's buffers
    k_nope = kn_desc.load([row, head])
    k_pe = kp_desc.load([row, 0])
    v = v_desc.load([row, head + V_COL])
    s = (tl.dot(q_nope, tl.trans(k_nope.to(DOT))) + tl.dot(q_pe, tl.trans(k_pe.to(DOT)))) * qk_scale
    if CAUSAL:
        s = tl.where((key < k_hi)[None, :] & ((key - k0)[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))


# Not specialized on `lo` and `hi` (a chunk's key range: prompt lengths decide them): Triton
# compiles a variant per integer argument's divisibility by 16, so serving met variants a
# warm-up had not and compiled them mid-step (what made a fresh H100 host's first prompt
# steps of workload B 204 ms against 36, with mla_decode's variants: results/kernels/
# compiled-while-serving-v2lite-h100.txt; those an idle engine launches first:
# worker/engine/attention_warmup.py). tests/gpu/test_kernels_ahead.py holds that a prompt
# of a new length compiles nothing. Neither feeds an address's alignment.
@triton.jit(do_not_specialize=["lo", "hi"])
def _prefill_chunk(
    q_nope_ptr, q_pe_ptr, kn_desc, kp_desc, v_desc, q_starts_ptr, kv_starts_ptr, lens_ptr,
    m_ptr, l_ptr, acc_ptr, out_ptr,
    lo, hi, qk_scale,
    stride_nt, stride_nh, stride_pt, stride_ph, stride_st, stride_at, stride_ah, stride_ot, stride_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, PN: tl.constexpr, PR: tl.constexpr, PV: tl.constexpr,
    HEAD_COLS: tl.constexpr, V_COL: tl.constexpr, FINAL: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(2)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last tiles (longest loops) start first
    q0 = tl.load(q_starts_ptr + b)
    n = tl.load(q_starts_ptr + b + 1) - q0
    if tile * BLOCK_M >= n:
        return
    ctx = tl.load(lens_ptr + b)
    k0 = tl.load(kv_starts_ptr + b)  # flat index of the sequence's position 0
    first = ctx - n + tile * BLOCK_M  # position of the tile's first new token
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live_q = rows < n
    q_pos = first + tl.arange(0, BLOCK_M)
    # This tile's keys in this chunk: its sequence's, up to its last query's position.
    k_lo = tl.maximum(k0, lo)
    k_hi = tl.minimum(k0 + ctx - n + tl.minimum(tile * BLOCK_M + BLOCK_M, n), hi)
    touched = k_hi > k_lo
    fresh = k0 >= lo

    t = (q0 + rows).to(tl.int64)
    dn, dr, dv = tl.arange(0, PN), tl.arange(0, PR), tl.arange(0, PV)
    # Rows whose state an earlier chunk left, read if this launch uses it. (Scalar
    # conditions join row masks through tl.where: the interpreter's `&` of the two
    # makes no boolean mask.)
    state = tl.where(fresh, False, live_q)
    if not FINAL:
        state = tl.where(touched, state, False)
    m = tl.load(m_ptr + t * stride_st + h, mask=state, other=float("-inf"))
    l = tl.load(l_ptr + t * stride_st + h, mask=state, other=0.0)
    acc_at = acc_ptr + t[:, None] * stride_at + h * stride_ah + dv[None, :]
    acc = tl.load(acc_at, mask=state[:, None] & (dv < DV)[None, :], other=0.0)

    if touched:
        q_nope = tl.load(q_nope_ptr + t[:, None] * stride_nt + h * stride_nh + dn[None, :],
                         mask=live_q[:, None] & (dn < DN)[None, :], other=0.0).to(DOT)
        q_pe = tl.load(q_pe_ptr + t[:, None] * stride_pt + h * stride_ph + dr[None, :],
                       mask=live_q[:, None] & (dr < DR)[None, :], other=0.0).to(DOT)
        head = h * HEAD_COLS  # this head's [k_nope | v] columns in a row of the chunk's buffer
        # Whole tiles of keys at or before the tile's first query are seen by every row: no
        # mask. The rest, up to the last query, straddle the diagonal.
        below = tl.maximum(tl.minimum(k_hi, k0 + first + 1) - k_lo, 0) // BLOCK_N * BLOCK_N
        for start in range(k_lo, k_lo + below, BLOCK_N):
            m, l, acc = _attend(m, l, acc, q_nope, q_pe, kn_desc, kp_desc, v_desc, start, lo, k0, k_hi, q_pos, head,
                                qk_scale, V_COL, DOT, BLOCK_N, CAUSAL=False)
        for start in range(k_lo + below, k_hi, BLOCK_N):
            m, l, acc = _attend(m, l, acc, q_nope, q_pe, kn_desc, kp_desc, v_desc, start, lo, k0, k_hi, q_pos, head,
                                qk_scale, V_COL, DOT, BLOCK_N, CAUSAL=True)

    if FINAL:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live_q[:, None] & (dv < DV)[None, :])
    else:
        keep = tl.where(touched, live_q, False)
        tl.store(m_ptr + t * stride_st + h, m, mask=keep)
        tl.store(l_ptr + t * stride_st + h, l, mask=keep)
        tl.store(acc_at, acc, mask=keep[:, None] & (dv < DV)[None, :])


def _state_buffers(rows: int, heads: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Running max, sum [T, H] and weighted values [T, H, dv] (float32), uninitialized:
    each row is written before it is read."""
    m, l = (torch.empty(rows, heads, dtype=torch.float32, device=device) for _ in range(2))
    return m, l, torch.empty(rows, heads, dv, dtype=torch.float32, device=device)


def _tile(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # a power of two, and at least what a dot takes


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b: torch.Tensor, pools: tuple,
                block_table: torch.Tensor, context_lens: torch.Tensor, q_starts: torch.Tensor,
                block_size: int, max_context: int, max_q: int, scale: float, chunk: int = CHUNK, *,
                out: torch.Tensor | None = None, context_tokens: int | None = None,
                plan: PrefillPlan | None = None) -> torch.Tensor:
    """Causal MLA of T new tokens against their contexts in the paged cache: arguments and
    result as for `prefill.mla_prefill_reference`. -> [T, H, dv] in q_nope's dtype."""
    rows, heads, dn = q_nope.shape
    dr = q_pe.shape[-1]
    dv = kv_b.shape[0] // heads - dn
    if out is None:
        out = q_nope.new_empty(rows, heads, dv)
    assert out.shape == (rows, heads, dv) and out.stride(-1) == 1, "out: [T, H, dv], rows contiguous"
    batch = context_lens.numel()
    if rows == 0 or batch == 0:
        return out
    plan = plan or prefill_plan(block_table, context_lens, q_starts, block_size, max_context, context_tokens)
    total = plan.total
    if total == 0:
        return out
    q_nope, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_nope, q_pe))
    m, l, acc = _state_buffers(rows, heads, dv, q_nope.device)
    chunk = min(chunk, total)
    kv = q_nope.new_empty(chunk, heads * (dn + dv))  # one buffer for every chunk's keys and values
    kv_b_t = kv_b.t()
    grid = (batch, triton.cdiv(max_q, BLOCK_M), heads)
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        whole = hi - lo == total  # (one chunk, as most steps have: no views of the whole to make)
        c, k_pe = chunk_latents(pools, plan.slots if whole else plan.slots[lo:hi], q_nope.dtype)
        keys = torch.matmul(c, kv_b_t, out=kv if whole else kv[: hi - lo])
        del c
        tiles, head_cols, v_col = _key_tiles(keys, k_pe, heads, dn, dv)
        launcher(_prefill_chunk)[grid](
            q_nope, q_pe, *tiles, plan.q_starts, plan.kv_starts, plan.context_lens, m, l, acc, out,
            lo, hi, scale * LOG2_E,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), m.stride(0), acc.stride(0),
            acc.stride(1), out.stride(0), out.stride(1),
            DN=dn, DR=dr, DV=dv, PN=_tile(dn), PR=_tile(dr), PV=_tile(dv), HEAD_COLS=head_cols, V_COL=v_col,
            FINAL=hi == total, DOT=dot_dtype(q_nope.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out


def _key_tiles(kv: torch.Tensor, k_pe: torch.Tensor, heads: int, dn: int, dv: int) -> tuple[tuple, int, int]:
    """TMA descriptors of a chunk's buffers, of its rows only (reads past them give zeros),
    and where a head's columns begin and its v within them: a head's k_nope and v tiles
    from kv [L, H * (dn + dv)], k_pe's from [L, dr]. A tile wider than dn or dv (the next
    power of two) takes the next columns, or zeros past a row's end: the queries' columns
    there are zeros, and v's extra columns are never written out. TMA reads tiles that begin
    16-byte aligned and are no wider than their tensor's rows (else an illegal instruction
    on the GPU), so heads whose columns are not (the GPU tests' small checkpoint: dn 16, dv
    12) are laid out again, each part zero-padded to its tile, and so is a rope part
    narrower than its tile (8 there)."""
    pn, pr, pv, size = _tile(dn), _tile(k_pe.shape[1]), _tile(dv), kv.element_size()
    head_cols, v_col = dn + dv, dn
    if head_cols * size % 16 or dn * size % 16:
        parts = kv.view(kv.shape[0], heads, dn + dv)
        kv = kv.new_zeros(kv.shape[0], heads, pn + pv)
        kv[..., :dn], kv[..., pn: pn + dv] = parts[..., :dn], parts[..., dn:]
        kv, head_cols, v_col = kv.view(kv.shape[0], -1), pn + pv, pn
    if pr != k_pe.shape[1]:
        k_pe = torch.nn.functional.pad(k_pe, (0, pr - k_pe.shape[1]))
    for t in (kv, k_pe):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16:
            raise ValueError(f"TMA reads rows that begin 16-byte aligned: {t.dtype} of strides {tuple(t.stride())}")
    tiles = (TensorDescriptor.from_tensor(kv, [BLOCK_N, pn]), TensorDescriptor.from_tensor(k_pe, [BLOCK_N, pr]),
             TensorDescriptor.from_tensor(kv, [BLOCK_N, pv]))
    return tiles, head_cols, v_col
