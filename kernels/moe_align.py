"""`align_by_expert` (kernels/fused_moe.py) in one Triton launch: the batch's (token, k)
pairs grouped by expert, each expert's run padded to a multiple of BLOCK_M, the expert of
each block of rows, and the number of rows in use. Same outputs, bit for bit; no host
sync, and sizes from the batch's shape only, so that a CUDA graph can hold it. (The torch
sequence is about 14 small kernels, a stable argsort among them: about 1 ms of an 8 ms
decode step over 26 MoE layers.)

No sort is needed: a pair's row is known once three counts are, all of the expert e it
was routed to:

    row = start[e] + (pairs of e before this chunk) + (pairs of e earlier in this chunk)

where start[e] is the exclusive cumulative sum of the padded run lengths. The programs
share nothing: each one histograms ALL the ids itself (tl.histogram, cheap next to a
launch: 16384 ids at most) instead of waiting for the others, and then writes rows no
other program writes:

- the pairs of its CHUNK (its rank among equal experts in the chunk: a CHUNK x CHUNK
  comparison; the running count before the chunk: the histogram of the ids before it);
- for its GROUP of blocks, the block's expert (searchsorted over the runs' ends, as a
  comparison with every end) and the sentinel `pairs` in every row of the block that no
  pair takes (padding of a run, or past the last run).

The rows of pairs and the rows of padding are disjoint and together all rows, so every
element of the outputs is written exactly once: no fill first, no barrier, no order
between programs, and buffers may hold anything before. Many programs rather than one
looping: the rows (about E * BLOCK_M of them even for one token) and the pairs (16384 in
a 2048-token prefill) are spread over the SMs, and all of them take the time of one.
In a CUDA graph on an H200 this is 2-4 us for up to 64 tokens and 12-24 us for 2048,
where the torch sequence takes 40-80 us and about 130 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher

GROUP = 32  # blocks of rows a program labels and pads: a GROUP x E tile
HIST = 1024  # ids a program histograms at a time


@triton.jit(do_not_specialize=["pairs", "num_blocks"])  # (counts, which change with each step's tokens)
def _align(
    ids_ptr, sorted_ptr, block_expert_ptr, padded_rows_ptr,
    pairs, num_experts, num_blocks,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr, HIST: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * CHUNK
    before_end = tl.minimum(first, pairs)

    # Each expert's pairs before this program's chunk, then among all pairs: every id is
    # counted once, into one of the two. (Bins past num_experts stay 0.)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, before_end, HIST):
        idx = s + tl.arange(0, HIST)
        e = tl.load(ids_ptr + idx, mask=idx < before_end, other=0).to(tl.int32)
        before += tl.histogram(e, E_PAD, mask=idx < before_end)
    counts = before
    for s in range(before_end, pairs, HIST):
        idx = s + tl.arange(0, HIST)
        e = tl.load(ids_ptr + idx, mask=idx < pairs, other=0).to(tl.int32)
        counts += tl.histogram(e, E_PAD, mask=idx < pairs)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    # The chunk's pairs. A pair's rank among the pairs of its expert earlier in the chunk
    # keeps each run in increasing pair order (the reference's stable argsort). Masked
    # lanes come after every valid one, so they never count as earlier.
    lane = tl.arange(0, CHUNK)
    pair = first + lane
    valid = pair < pairs
    e = tl.load(ids_ptr + pair, mask=valid, other=0).to(tl.int32)
    earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    row = tl.gather(starts + before, e, 0) + rank
    tl.store(sorted_ptr + row, pair, mask=valid)

    # The group's blocks. A block's expert: the number of runs that end at or before its
    # first row (searchsorted, right=True), clamped as the reference clamps blocks past
    # the end (where padded bins' ends, all equal to the total, count too). Its rows from
    # `limit` on hold no pair: the run's padding, or all of a block past the end, whose
    # first row no run contains (limit 0).
    block = pid * GROUP + tl.arange(0, GROUP)
    first_row = block * BLOCK_M
    expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + block, tl.minimum(expert, num_experts - 1), mask=block < num_blocks)
    inside = (starts[None, :] <= first_row[:, None]) & (first_row[:, None] < ends[None, :])
    limit = tl.sum(tl.where(inside, (starts + counts)[None, :], 0), axis=1)
    rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
    no_pair = (block < num_blocks)[:, None] & (rows >= limit[:, None])
    tl.store(sorted_ptr + rows, tl.zeros([GROUP, BLOCK_M], dtype=tl.int32) + pairs, mask=no_pair)

    if pid == 0:
        tl.store(padded_rows_ptr, tl.sum(padded, axis=0))


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                           out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """(sorted_pairs, block_expert, padded_rows) exactly as `fused_moe.align_by_expert`
    gives them, for topk_ids [T, k] (int32 or int64) in one launch. `out`: the three int32
    buffers to write instead of new ones, of any contents (every element is written)."""
    flat = topk_ids.reshape(-1)
    pairs, dev = flat.numel(), flat.device
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = capacity // block_m
    if out is None:
        out = (torch.empty(capacity, dtype=torch.int32, device=dev),
               torch.empty(num_blocks, dtype=torch.int32, device=dev),
               torch.empty(1, dtype=torch.int32, device=dev))
    sorted_pairs, block_expert, padded_rows = out
    shapes = [(capacity,), (num_blocks,), (1,)]
    if [o.shape for o in out] != shapes or any(o.dtype != torch.int32 or not o.is_contiguous() for o in out):
        raise ValueError(f"out: contiguous int32 buffers of {capacity}, {num_blocks} and 1 elements are needed")
    # Pairs a program places: up to 128 programs, about one wave on an H200's 132 SMs,
    # of 32 to 128 pairs; a smaller chunk as long as that allows, since its rank tile
    # grows as the square (measured in CUDA graphs on an H200, V2-Lite's and V3's routing:
    # 32 best up to 512 tokens, 128 at 2048 tokens, where 32 took twice as long).
    chunk = min(max(triton.next_power_of_2(pairs) // 128, 32), 128)
    grid = (max(triton.cdiv(pairs, chunk), triton.cdiv(num_blocks, GROUP), 1),)
    # (histogram bins: a power of two, at least a warp's 32 lanes, which the GPU's histogram needs)
    e_pad = max(triton.next_power_of_2(num_experts), 32)
    launcher(_align)[grid](
        flat, sorted_pairs, block_expert, padded_rows, pairs, num_experts, num_blocks,
        E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, GROUP=GROUP, HIST=min(HIST, triton.next_power_of_2(max(pairs, 1))),
    )
    return sorted_pairs, block_expert, padded_rows
