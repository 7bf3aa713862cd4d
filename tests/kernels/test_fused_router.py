"""The fused router (Triton) routes as the gate product followed by `route_softmax` (V2)
or `route_sigmoid` (V3) does: the same experts for every token, in any order, with the
same weights, returned as the references return them (float32 weights, int64 ids).
Without a GPU it runs in Triton's interpreter (tests/conftest.py); `-m gpu` adds the
real models' shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE  # noqa: E402

from preload.kernels.fused_router import fused_route, fused_route_logits, gate_partials  # noqa: E402
from preload.kernels.moe import route_sigmoid, route_softmax  # noqa: E402

# (experts, top_k, n_group, topk_group, scoring, grouped, norm_topk_prob, routed_scaling_factor)
CONFIGS = {
    "v2-lite": (64, 6, 1, 1, "softmax", False, False, 1.0),
    "v2": (160, 6, 8, 3, "softmax", True, False, 16.0),
    "v2-renormalized": (160, 6, 8, 3, "softmax", True, True, 16.0),  # renormalizes, does not scale
    "top1-softmax": (64, 1, 1, 1, "softmax", False, True, 2.0),  # one expert: scaled, not renormalized
    "v3": (256, 8, 8, 4, "sigmoid", True, True, 2.5),
    "v3-unnormalized": (256, 8, 8, 4, "sigmoid", True, False, 2.5),
}


def reference(logits, bias, top_k, n_group, topk_group, scoring, grouped, norm, scaling):
    if scoring == "sigmoid":
        return route_sigmoid(logits, bias, top_k, n_group, topk_group, norm, scaling)
    return route_softmax(logits, top_k, n_group, topk_group, grouped, norm, scaling)


def case(config: str, tokens: int, seed: int = 0):
    experts, *_, scoring, _, _, _ = CONFIGS[config]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.1 if scoring == "sigmoid" else None
    return logits, bias


def margin(logits, bias, top_k, n_group, topk_group, scoring, grouped):
    """How far each token's choice is from a tie, relative to the scores compared: between
    the last group kept and the first dropped, and between the k-th expert and the next.
    The kernel's float32 sums round differently from torch's; only near-ties can turn."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    grouped = grouped or scoring == "sigmoid"

    def gap(values, k):
        top = values.topk(k + 1, dim=-1).values
        return ((top[:, k - 1] - top[:, k]) / top[:, k - 1].abs()).nan_to_num(float("inf"))

    gaps = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    if grouped and topk_group < n_group:
        per_group = choice.unflatten(-1, (n_group, -1))
        group = per_group.amax(-1) if scoring == "softmax" else per_group.topk(2, dim=-1).values.sum(-1)
        gaps = gap(group, topk_group)
        kept = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(logits.shape[1] // n_group, -1), float("-inf"))
    if top_k < choice.shape[1]:
        gaps = torch.minimum(gaps, gap(choice, top_k))
    return gaps


def assert_same_routes(got, want, decided=None, atol=1e-6):
    """Per token: the same set of ids and, in that order, the same weights. Tokens not
    `decided` (a near-tie that rounding may settle either way) are not compared."""
    (w, ids), (want_w, want_ids) = got, want
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == want_ids.shape
    assert not w.isnan().any()
    ids, order = ids.sort(-1)
    want_ids, want_order = want_ids.sort(-1)
    w, want_w = w.gather(1, order), want_w.gather(1, want_order)
    if decided is not None:
        ids, want_ids, w, want_w = ids[decided], want_ids[decided], w[decided], want_w[decided]
    assert torch.equal(ids, want_ids), (ids != want_ids).any(-1).nonzero().flatten().tolist()
    assert torch.allclose(w, want_w, atol=atol, rtol=1e-5), (w - want_w).abs().max()


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_routing_logits_equals_the_reference(config, tokens):
    logits, bias = case(config, tokens)
    want = reference(logits, bias, *CONFIGS[config][1:])
    got = fused_route_logits(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), *CONFIGS[config][1:])
    assert_same_routes(tuple(t.cpu() for t in got), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config, tokens", [("v2-lite", 1), ("v2", 37), ("v3", 1), ("v3", 37)])
def test_fused_route_equals_the_gate_product_then_the_reference(config, tokens, dtype):
    """x as rows of a wider buffer whose other columns are NaN: nothing past D is read.
    D = 300 is not a multiple of the kernel's blocks."""
    experts, *routing = CONFIGS[config]
    gen = torch.Generator().manual_seed(1)
    d = 300
    wide = torch.full((tokens, d + 20), float("nan"))
    wide[:, :d] = torch.randn(tokens, d, generator=gen)
    x = wide.to(dtype).to(DEVICE)[:, :d]
    gate = (torch.randn(experts, d, generator=gen) * 0.2).to(dtype).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if routing[3] == "sigmoid" else None
    logits = F.linear(x.float(), gate.float())
    got = fused_route(x, gate, bias, *routing)
    assert_same_routes(got, reference(logits, bias, *routing), margin(logits, bias, *routing[:5]) > 1e-5)


@pytest.mark.parametrize("x_dtype, gate_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_the_gate_product_split_along_d_sums_to_the_float32_product(x_dtype, gate_dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 1600, generator=gen).to(x_dtype).to(DEVICE)
    gate = (torch.randn(40, 1600, generator=gen) * 0.05).to(gate_dtype).to(DEVICE)
    parts = gate_partials(x, gate)
    assert parts.shape[0] > 1, "a few tokens: the gate's reading is spread over splits of D"
    want = F.linear(x.float(), gate.float())
    assert torch.allclose(parts.sum(0), want, atol=1e-5, rtol=1e-5), (parts.sum(0) - want).abs().max()


def test_v2_keeps_the_best_groups_scored_by_their_best_expert():
    """Four groups of four, one kept: group 1 holds the single best expert, so both
    choices come from it, although expert 0 (group 0) is second best overall."""
    logits = torch.full((1, 16), -4.0)
    logits[0, 0], logits[0, 5], logits[0, 6] = 3.0, 3.5, 1.0
    weights, ids = fused_route_logits(logits.to(DEVICE), None, 2, 4, 1, "softmax", True, False, 1.0)
    assert sorted(ids[0].tolist()) == [5, 6]
    scores = logits.softmax(-1)[0]
    assert torch.allclose(weights[0].sort().values.cpu(), scores[[6, 5]], rtol=1e-5)


def test_v3_keeps_the_groups_whose_best_two_sum_highest_and_weighs_by_unbiased_scores():
    """Group 0's best expert is the best of all, but group 2's best two sum higher. The
    bias lifts expert 9 into the choice; its weight is its score without the bias."""
    scores = torch.full((1, 16), 0.05)
    scores[0, 0], scores[0, 8], scores[0, 10], scores[0, 9] = 0.95, 0.7, 0.6, 0.3
    bias = torch.zeros(16)
    bias[9] = 0.35  # 0.3 + 0.35 beats 0.6
    logits = torch.logit(scores)
    weights, ids = fused_route_logits(logits.to(DEVICE), bias.to(DEVICE), 2, 4, 1, "sigmoid", True, False, 3.0)
    assert sorted(ids[0].tolist()) == [8, 9]
    w = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert w[9] == pytest.approx(0.3 * 3.0, rel=1e-5) and w[8] == pytest.approx(0.7 * 3.0, rel=1e-5)


def test_an_impossible_configuration_is_refused():
    with pytest.raises(ValueError):
        fused_route_logits(torch.zeros(1, 64, device=DEVICE), None, 9, 8, 1, "softmax", True, False, 1.0)
    with pytest.raises(ValueError):
        fused_route_logits(torch.zeros(1, 64, device=DEVICE), None, 2, 8, 1, "sigmoid", True, False, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("tokens", [1, 64, 512, 2048])
@pytest.mark.parametrize("config, d", [("v2-lite", 2048), ("v2", 5120), ("v3", 7168)])
def test_real_shapes_on_the_gpu(config, d, tokens, gate_dtype):
    """(A float32 gate, as checkpoints keep it, takes three TF32 products: as IEEE float32
    to the routes and within 1e-5 of its weights.)"""
    experts, *routing = CONFIGS[config]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).cuda()
    gate = (torch.randn(experts, d, generator=gen) * d**-0.5).to(gate_dtype).cuda()
    bias = (torch.randn(experts, generator=gen) * 0.1).cuda() if routing[3] == "sigmoid" else None
    logits = F.linear(x.float(), gate.float())
    decided = margin(logits, bias, *routing[:5]) > 1e-4
    assert decided.float().mean() >= 0.9
    assert_same_routes(fused_route(x, gate, bias, *routing), reference(logits, bias, *routing), decided, atol=1e-5)


@pytest.mark.gpu
def test_a_cuda_graph_replays_it_for_new_tokens():
    experts, *routing = CONFIGS["v3"]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 7168, generator=gen).to(torch.bfloat16).cuda()
    gate = (torch.randn(experts, 7168, generator=gen) * 7168**-0.5).to(torch.bfloat16).cuda()
    bias = (torch.randn(experts, generator=gen) * 0.1).cuda()
    fused_route(x, gate, bias, *routing)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fused_route(x, gate, bias, *routing)
    x.copy_(torch.randn(16, 7168, generator=gen).to(torch.bfloat16))
    graph.replay()
    logits = F.linear(x.float(), gate.float())
    decided = margin(logits, bias, *routing[:5]) > 1e-4
    assert_same_routes(got, reference(logits, bias, *routing), decided, atol=1e-5)
