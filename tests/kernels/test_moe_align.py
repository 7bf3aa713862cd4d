"""`align_by_expert_triton` (one Triton launch) gives exactly what `fused_moe.align_by_expert`
(the torch reference) gives: the same pairs in the same rows, the same expert for every
block, the same count of rows in use, for any routing (spread, skewed, experts unused),
int32 or int64 ids, and whatever its buffers held before. On the GPU it also runs at a
prefill's size and inside a CUDA graph replayed with new ids. Without a GPU it runs in
Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from preload.kernels.fused_moe import align_by_expert  # noqa: E402
from preload.kernels.moe_align import align_by_expert_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(tokens: int, top_k: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Ids as a router gives them: k distinct experts per token, in no particular order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)


def assert_aligned_as_the_reference(ids: torch.Tensor, experts: int, block_m: int, **kwargs) -> None:
    want = align_by_expert(ids.long(), experts, block_m)  # (its scatter_add needs int64 ids)
    got = align_by_expert_triton(ids, experts, block_m, **kwargs)
    for name, g, w in zip(("sorted_pairs", "block_expert", "padded_rows"), got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g, w), (name, (g != w).nonzero().flatten()[:8].tolist())


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("experts", [64, 160, 256])  # V2-Lite, V2 (not a power of two), V3
@pytest.mark.parametrize("top_k", [6, 8])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_equals_the_reference_for_routed_ids(tokens, top_k, experts, block_m):
    ids = routed(tokens, top_k, experts, seed=tokens * experts + top_k)
    assert_aligned_as_the_reference(ids.to(torch.int32), experts, block_m)
    assert_aligned_as_the_reference(ids, experts, block_m)  # int64, as topk gives them


@pytest.mark.parametrize("experts, block_m", [(64, 16), (160, 64), (256, 16)])
def test_equals_the_reference_for_many_chunks_of_pairs(experts, block_m):
    # 513 tokens: several programs' chunks of pairs, the last one partial
    assert_aligned_as_the_reference(routed(513, 8, experts, seed=experts), experts, block_m)


@pytest.mark.parametrize("experts, top_k", [(2, 1), (8, 3)])  # fewer experts than a warp's 32 lanes
@pytest.mark.parametrize("block_m", [4, 16])
def test_equals_the_reference_for_few_experts(experts, top_k, block_m):
    assert_aligned_as_the_reference(routed(9, top_k, experts), experts, block_m)


def skewed(tokens: int, top_k: int, experts: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randperm(top_k * 2, generator=gen)[:top_k] for _ in range(tokens)]
    return {
        "all to the first expert": torch.zeros(tokens, top_k, dtype=torch.long),
        "all to the last expert": torch.full((tokens, top_k), experts - 1),
        "the same k experts for all": torch.arange(top_k).repeat(tokens, 1),
        "a few experts, the rest unused": torch.stack(rows) * (experts // (top_k * 2)),
        "every other expert unused": torch.randint(0, experts // 2, (tokens, top_k), generator=gen) * 2,
    }


@pytest.mark.parametrize("case", list(skewed(1, 1, 2)))
@pytest.mark.parametrize("tokens", [1, 64])
def test_equals_the_reference_for_skewed_routing(case, tokens):
    experts, top_k = 160, 6
    ids = skewed(tokens, top_k, experts)[case].to(DEVICE)
    for block_m in (16, 64):
        assert_aligned_as_the_reference(ids, experts, block_m)


def test_an_empty_batch_has_no_rows_in_use():
    assert_aligned_as_the_reference(torch.zeros(0, 8, dtype=torch.long, device=DEVICE), 64, 16)


@pytest.mark.parametrize("garbage", [-1, 0, 7, 2**31 - 1])
def test_every_element_of_the_buffers_is_written(garbage):
    """What the buffers held before does not show: there is no fill to forget (0 and 7
    would pass for pair indices, -1 and the largest int for nothing)."""
    ids = routed(9, 6, 64, seed=5)
    capacity = triton.cdiv(ids.numel() + 64 * 15, 16) * 16
    out = tuple(torch.full((n,), garbage, dtype=torch.int32, device=DEVICE) for n in (capacity, capacity // 16, 1))
    assert_aligned_as_the_reference(ids, 64, 16, out=out)
    assert all(o.data_ptr() == g.data_ptr() for o, g in zip(out, align_by_expert_triton(ids, 64, 16, out=out)))


def test_buffers_of_the_wrong_size_are_refused():
    ids = routed(2, 6, 64)
    capacity = triton.cdiv(ids.numel() + 64 * 15, 16) * 16
    for sizes, dtype in [((16, 1, 1), torch.int32), ((capacity, capacity // 16, 1), torch.int64)]:
        out = tuple(torch.empty(n, dtype=dtype, device=DEVICE) for n in sizes)
        with pytest.raises(ValueError, match="buffers of"):
            align_by_expert_triton(ids, 64, 16, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, top_k", [(64, 6), (160, 6), (256, 8)])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_equals_the_reference_at_prefill_scale(experts, top_k, block_m):
    ids = routed(2048, top_k, experts, seed=7)
    assert_aligned_as_the_reference(ids, experts, block_m)
    assert_aligned_as_the_reference(skewed(2048, top_k, experts)["a few experts, the rest unused"].to(DEVICE),
                                    experts, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_a_cuda_graph_replayed_with_new_ids_gives_their_alignment(tokens):
    experts, top_k, block_m = 256, 8, 16
    ids = routed(tokens, top_k, experts, seed=1)
    static = ids.clone()
    align_by_expert_triton(static, experts, block_m)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = align_by_expert_triton(static, experts, block_m)
    for seed, new in [(2, routed(tokens, top_k, experts, seed=2)), (3, torch.zeros_like(ids)),
                      (4, routed(tokens, top_k, experts, seed=4))]:
        static.copy_(new)
        graph.replay()
        want = align_by_expert(new, experts, block_m)
        assert all(torch.equal(g, w) for g, w in zip(outputs, want)), seed
