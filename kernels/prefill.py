"""Chunked MLA prefill over the paged latent cache, in memory bounded by the chunk.

A prefill step's new tokens attend causally to their whole context, most of which may
already be cached (a long prompt fed in pieces, a prefix hit). Gathering every context
and masking [B, Q, K] (`attention.mla_expanded`) costs O(queries x context) memory; here
the contexts are walked a chunk at a time and the softmax is carried across chunks, as
flash attention carries it across key tiles:

1. Every sequence's context is laid end to end in one flat order (sequence 0's positions
   0..ctx_0-1, then sequence 1's, ...). A chunk is `chunk` consecutive tokens of that
   order, whichever sequences they belong to, so a chunk's size, and with it the memory
   of a step, does not grow with the batch, nor do short contexts pad a chunk out.
2. A chunk's latents are gathered through the block tables, dequantized (e4m3 rows with
   a float32 scale each), and up-projected with kv_b to per-head keys and values in one
   GEMM: the expanded form, cheapest when many queries share the keys.
3. Every query of the chunk's sequences attends to the chunk's keys at positions up to
   its own, and its running max, sum and weighted values (float32, one row per query and
   head) are updated. After the last chunk, out = weighted values / sum.

Extra memory: the chunk's keys and values, chunk x H x (dn + dv), and the running state,
T x H x (dv + 2) floats, whatever the contexts' length.

This module is the torch form, the CPU path and the oracle; `mla_prefill.mla_prefill`
is the Triton kernel of step 3 on the GPU, taking the same arguments. Here a block of at
most QUERY_ROWS queries is scored against a chunk at once. Decode rows (one new token
against a long context) are better served by the absorbed form (`attention.mla_decode`):
here each of their context tokens is up-projected for a single query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK = 4096  # context tokens up-projected at a time
QUERY_ROWS = 256  # the reference's queries scored against a chunk at a time


def context_starts(context_lens: torch.Tensor) -> torch.Tensor:
    """Where each sequence's context begins in the flat order [B + 1] (int64): its running sum."""
    return torch.nn.functional.pad(context_lens.long().cumsum(0), (1, 0))


def flat_context_length(context_lens: torch.Tensor, max_context: int, context_tokens: int | None) -> int:
    """Tokens in all the contexts together, needed on the host to count the chunks: the
    caller's count, or with one sequence its context, or else read back (one sync)."""
    if context_tokens is not None:
        return context_tokens
    return max_context if context_lens.numel() == 1 else int(context_lens.sum())


class PrefillPlan(NamedTuple):
    """What the chunked prefill takes from a step's layout alone, the same in every layer:
    made once a step (`prefill_plan`), not once a layer (on the GPU each of its dozen small
    launches is host time between a replayed step's pieces)."""

    kv_starts: torch.Tensor  # [B + 1] int64: where each context begins in the flat order
    q_starts: torch.Tensor  # [B + 1] int64
    context_lens: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [total] int64: the cache slot of each flat context token
    total: int  # the flat order's length


def prefill_plan(block_table: torch.Tensor, context_lens: torch.Tensor, q_starts: torch.Tensor, block_size: int,
                 max_context: int, context_tokens: int | None = None) -> PrefillPlan:
    """The plan of a step whose prompts have these block tables and context lengths."""
    total = flat_context_length(context_lens, max_context, context_tokens)
    kv_starts = context_starts(context_lens)
    seq, pos = context_positions(kv_starts, 0, total)
    slots = block_table.long()[seq, pos // block_size] * block_size + pos % block_size
    return PrefillPlan(kv_starts, q_starts.long(), context_lens.long(), slots, total)


def context_positions(kv_starts: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and position of flat context tokens lo .. hi-1 [L]."""
    flat = torch.arange(lo, hi, device=kv_starts.device)
    seq = torch.searchsorted(kv_starts[1:], flat, right=True)
    return seq, flat - kv_starts[seq]


def chunk_latents(pools: tuple, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached rows at `slots` (a chunk of the plan's): (c_kv [L, r], k_pe [L, dr]) in `dtype`."""
    c_kv, k_pe, c_scale, k_scale = pools[:4]
    c, k = c_kv[slots], k_pe[slots]
    if c_scale is not None:  # e4m3 rows with a scale each
        return (c.float() * c_scale[slots]).to(dtype), (k.float() * k_scale[slots]).to(dtype)
    return c.to(dtype), k.to(dtype)


def query_positions(q_starts: torch.Tensor, context_lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and position of each of the T new tokens [T]: a sequence's new tokens are
    the last of its context."""
    row = torch.arange(rows, device=q_starts.device)
    seq = torch.searchsorted(q_starts[1:], row, right=True)
    return seq, context_lens.long()[seq] - q_starts[seq + 1] + row


def mla_prefill_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b: torch.Tensor, pools: tuple,
                          block_table: torch.Tensor, context_lens: torch.Tensor, q_starts: torch.Tensor,
                          block_size: int, max_context: int, max_q: int, scale: float, chunk: int = CHUNK, *,
                          out: torch.Tensor | None = None, context_tokens: int | None = None,
                          plan: PrefillPlan | None = None) -> torch.Tensor:
    """Causal MLA of T new tokens against their contexts in the paged cache, chunk by chunk.

    q_nope [T, H, dn], q_pe [T, H, dr]; kv_b [H*(dn+dv), r] dense, in the activations'
    dtype; pools: one layer's cache as `attention.Pools` holds it, of which the first four
    are read: c_kv [S, r], k_pe [S, dr], and their scales [S, 1] (e4m3) or None;
    block_table [B, NB] (any int dtype); context_lens [B]: each context's length, its new
    tokens (already cached) included; q_starts [B + 1] (int64): sequence b's new tokens
    are rows q_starts[b] .. q_starts[b+1]-1 (q_starts[B] == T), the last positions of its
    context. max_context, max_q: no context is longer, no sequence has more new tokens
    (the kernel's grid). scale: the softmax's. chunk: context tokens up-projected at a
    time. context_tokens: sum(context_lens) if the caller knows it on the host (else it
    is read back, unless there is one sequence). out: [T, H, dv] to write into. plan: the
    step's `prefill_plan` of these arguments, if made already (a layer before).
    -> [T, H, dv] in q_nope's dtype.
    """
    rows, heads, dn = q_nope.shape
    dv = kv_b.shape[0] // heads - dn
    if out is None:
        out = q_nope.new_empty(rows, heads, dv)
    plan = plan or prefill_plan(block_table, context_lens, q_starts, block_size, max_context, context_tokens)
    total = plan.total
    q_seq, q_pos = query_positions(q_starts, context_lens, rows)
    m = q_nope.new_full((rows, heads), float("-inf"), dtype=torch.float32)
    l = torch.zeros_like(m)
    acc = q_nope.new_zeros(rows, heads, dv, dtype=torch.float32)
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        c, k_pe = chunk_latents(pools, plan.slots[lo:hi], q_nope.dtype)
        k_seq, k_pos = context_positions(plan.kv_starts, lo, hi)
        kv = (c @ kv_b.t()).unflatten(-1, (heads, -1)).float()  # [L, H, dn + dv]
        k_nope, v = kv[..., :dn], kv[..., dn:]
        for a in range(0, rows, QUERY_ROWS):
            b = min(a + QUERY_ROWS, rows)
            seen = (q_seq[a:b, None] == k_seq) & (k_pos <= q_pos[a:b, None])  # [q, L]
            s = (torch.einsum("qhd,khd->qhk", q_nope[a:b].float(), k_nope)
                 + torch.einsum("qhd,kd->qhk", q_pe[a:b].float(), k_pe.float())) * scale
            s = s.masked_fill(~seen[:, None], float("-inf"))
            m_new = torch.maximum(m[a:b], s.amax(-1))
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that has seen nothing yet stays empty
            p = torch.exp(s - m_use[..., None])
            alpha = torch.exp(m[a:b] - m_use)
            l[a:b] = l[a:b] * alpha + p.sum(-1)
            acc[a:b] = acc[a:b] * alpha[..., None] + torch.einsum("qhk,khd->qhd", p, v)
            m[a:b] = m_new
    out.copy_(acc / l[..., None])
    return out
