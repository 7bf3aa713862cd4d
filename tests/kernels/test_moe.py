"""A layer's gate and up projections lying one after the other in memory, as the arena
stores them, are seen as one matrix (a view, never a copy), so that a GPU computes both in
one product; anything else (apart, a gap, another shape or dtype, e4m3) is not."""

from __future__ import annotations

import torch

from preload.kernels.moe import side_by_side
from preload.kernels.quant import Fp8Weight


def arena(*shapes: tuple[int, int], gap: int = 0) -> list[torch.Tensor]:
    """Matrices laid out back to back in one buffer (`gap` elements between them)."""
    sizes = [r * c for r, c in shapes]
    buffer = torch.randn(sum(sizes) + gap * len(shapes), dtype=torch.bfloat16)
    out, at = [], 0
    for (r, c), n in zip(shapes, sizes):
        out.append(buffer[at : at + n].view(r, c))
        at += n + gap
    return out


def test_adjacent_matrices_are_one_view_of_both():
    gate, up = arena((6, 4), (6, 4))
    both = side_by_side(gate, up)
    assert both.shape == (12, 4) and both.data_ptr() == gate.data_ptr()
    assert torch.equal(both, torch.cat([gate, up]))
    up.add_(1)  # (a view: the arena's own memory)
    assert torch.equal(both[6:], up)


def test_matrices_apart_or_unlike_are_not():
    gate, up = arena((6, 4), (6, 4), gap=8)
    assert side_by_side(gate, up) is None
    assert side_by_side(*arena((6, 4), (5, 4))) is None
    assert side_by_side(torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(6, 4, dtype=torch.bfloat16)) is None
    up_first, gate_after = arena((6, 4), (6, 4))
    assert side_by_side(gate_after, up_first) is None  # (the order the product's halves are read in)
    q = torch.zeros(6, 4).to(torch.float8_e4m3fn)
    assert side_by_side(Fp8Weight(q, torch.ones(1, 1), (128, 128)), Fp8Weight(q, torch.ones(1, 1), (128, 128))) is None
