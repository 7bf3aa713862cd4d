"""Mixture-of-experts routing and expert evaluation.

Routing returns, per token, the ids of its top-k experts and their mixing weights.
V2 scores with softmax and picks greedily (optionally within the best groups); V3
scores with a sigmoid, picks with a per-expert bias that only steers the choice
(aux-loss-free balancing), and takes weights from the unbiased scores.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from preload.kernels.linear import linear
from preload.kernels.quant import Fp8Weight, Weight


def _mask_to_top_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    n_group = group_scores.shape[-1]
    keep_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    expert_mask = group_mask.repeat_interleave(scores.shape[-1] // n_group, dim=-1)
    return scores.masked_fill(~expert_mask, fill)


def route_softmax(
    logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    grouped: bool,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: softmax scores, greedy or group-limited greedy top-k."""
    scores = logits.float().softmax(dim=-1)
    choice = scores
    if grouped:
        group_scores = scores.unflatten(-1, (n_group, -1)).amax(dim=-1)
        choice = _mask_to_top_groups(scores, group_scores, topk_group, 0.0)
    weights, ids = choice.topk(top_k, dim=-1, sorted=False)
    # V2 either renormalizes the chosen weights or scales them, never both.
    if top_k > 1 and norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * scaling
    return weights, ids


def route_sigmoid(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores, biased group-limited choice."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    group_scores = choice.unflatten(-1, (n_group, -1)).topk(2, dim=-1).values.sum(dim=-1)
    choice = _mask_to_top_groups(choice, group_scores, topk_group, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
          scoring: str, grouped: bool, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k]) of x [T, D] through the gate [E, D]: V3's
    route_sigmoid (scoring "sigmoid", with the correction bias) or V2's route_softmax. On a
    GPU the gate product and all the routing in two Triton launches (fused_router.py)."""
    if x.is_cuda:
        from preload.kernels.fused_router import fused_route  # Triton: imported only where there is a GPU

        return fused_route(x, gate, bias, top_k, n_group, topk_group, scoring, grouped, norm_topk_prob, scaling)
    logits = F.linear(x.float(), gate.float())
    if scoring == "sigmoid":
        return route_sigmoid(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    return route_softmax(logits, top_k, n_group, topk_group, grouped, norm_topk_prob, scaling)


def side_by_side(first: Weight, second: Weight) -> torch.Tensor | None:
    """One [2N, K] view of two [N, K] matrices where the second follows the first in memory
    (the arena lays tensors out in the checkpoint's order, whose names sort a layer's
    gate_proj just before its up_proj), else None: never a copy."""
    if isinstance(first, Fp8Weight) or isinstance(second, Fp8Weight):
        return None  # (e4m3's scales lie between the two)
    n, k = first.shape
    if (second.shape != first.shape or second.dtype != first.dtype or not first.is_contiguous()
            or not second.is_contiguous() or second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or second.data_ptr() != first.data_ptr() + first.nbytes):
        return None
    return first.as_strided((2 * n, k), (k, 1))


def swiglu(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """down(silu(gate x) * up x): the feed-forward of every dense layer and expert.
    (fp8 on a GPU, a few rows: gate, up and SiLU in one launch, fp8_linear.fp8_swiglu.)
    On a GPU, gate and up lying side by side are one product: at a decode batch each of
    the shared experts' three cuBLAS calls took 7.6 us on an H100 for 11.5 MB, a read at
    half the card's rate; one call over both reads 23 MB."""
    if isinstance(gate, Fp8Weight) and isinstance(up, Fp8Weight) and x.is_cuda:
        from preload.kernels.fp8_linear import fp8_swiglu  # Triton: imported only where there is a GPU

        h = fp8_swiglu(x, gate, up)
        if h is not None:
            return linear(h, down)
    both = side_by_side(gate, up) if x.is_cuda else None
    if both is not None:
        g, u = F.linear(x, both).chunk(2, -1)
        return linear(F.silu(g) * u, down)
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


Expert = Callable[[torch.Tensor], torch.Tensor]


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Sequence[Expert | None]) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * expert(x). x [T, D], ids/weights [T, k].
    An expert None is another process's (expert parallelism): its share is summed there."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if experts[e] is None:
            continue
        token, slot = torch.where(ids == e)
        y = experts[e](x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def moe_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Sequence[Expert],
              stacked: Callable[[], tuple], shared: tuple[Weight, Weight, Weight] | None) -> torch.Tensor:
    """The routed experts' sum plus the shared experts' output (shared: their gate, up and
    down, or None). The reference loop on the CPU; on a GPU, a decode step's few tokens in
    two launches (moe_decode.py), more through the grouped GEMMs (fused_moe.py), over
    `stacked()`, the experts' (gate, up, down) as [E, ...] views."""
    if x.is_cuda:  # Triton: imported only where there is a GPU
        from preload.kernels.fused_moe import fused_moe
        from preload.kernels.moe_decode import fits, moe_decode

        gate, up, down = stacked()
        if fits(x.shape[0], gate, up, down, shared):
            return moe_decode(x, ids, weights, gate, up, down, shared)
        return fused_moe(x, ids, weights, gate, up, down, add=swiglu(x, *shared) if shared is not None else None)
    y = moe_experts(x, ids, weights, experts)
    return y + swiglu(x, *shared) if shared is not None else y
