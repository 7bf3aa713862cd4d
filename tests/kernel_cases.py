"""Inputs for the kernels' tests, on the GPU when there is one."""

from __future__ import annotations

import torch

from preload.kernels.attention import Pools
from preload.kernels.fp8 import FP8, FP8_MAX, quantize_block
from preload.kernels.quant import Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def with_ptrs(pools: Pools) -> Pools:
    """The pools with their addresses where the kernels read them (on the device)."""
    return pools._replace(ptrs=torch.tensor(pools.addresses(), dtype=torch.long, device=DEVICE))


def as_float(pools: Pools) -> Pools:
    """The pools in float32, for the references."""
    return Pools(*(p.float() if p is not None else None for p in pools[:4]))


def paged_case(lens: list[int], heads: int, rank: int, rope: int, page: int, fp8: bool, seed: int = 0):
    """Random queries and a cache whose blocks are handed out in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks_each) + 3, generator=gen).tolist()  # spare blocks stay unused
    tables, at = [], 0
    for n in blocks_each:
        tables.append(order[at : at + n] + [0] * (max(blocks_each) - n))
        at += n
    slots = len(order) * page
    c_kv, k_pe = torch.randn(slots, rank, generator=gen), torch.randn(slots, rope, generator=gen)
    if fp8:
        pools = []
        for x in (c_kv, k_pe):
            scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
            pools.append(((x / scale).to(FP8).to(DEVICE), scale.to(DEVICE)))
        pools = with_ptrs(Pools(pools[0][0], pools[1][0], pools[0][1], pools[1][1]))
    else:
        pools = with_ptrs(Pools(c_kv.to(torch.bfloat16).to(DEVICE), k_pe.to(torch.bfloat16).to(DEVICE)))
    q_lat = torch.randn(len(lens), heads, rank, generator=gen).to(torch.bfloat16).to(DEVICE)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen).to(torch.bfloat16).to(DEVICE)
    table = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q_lat, q_pe, pools, table, ctx


def experts(num: int, d: int, inner: int, quant: str, gen: torch.Generator) -> list[tuple]:
    """Each expert's (gate, up, down), laid out one after another in one buffer as the
    arena does, as views into it."""
    mats = [[torch.randn(*shape, generator=gen) * 0.05 for shape in ((inner, d), (inner, d), (d, inner))]
            for _ in range(num)]
    if quant == "none":
        flat = torch.cat([m.flatten() for e in mats for m in e]).to(torch.bfloat16).to(DEVICE)
        views, at = [], 0
        for e in mats:
            views.append(tuple(flat[at + sum(m.numel() for m in e[:i]):][: e[i].numel()].view(e[i].shape) for i in range(3)))
            at += sum(m.numel() for m in e)
        return views
    block = (128, 128) if quant == "fp8_block" else None
    return [tuple(Fp8Weight(*[t.to(DEVICE) for t in quantize_block(m, block or m.shape)], block or m.shape)
                  for m in e) for e in mats]
