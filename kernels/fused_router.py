"""MoE routing in two launches (Triton): the gate's logits, then scoring, the choice of
groups and of the top-k experts, and the weights, for every token. The references are
`moe.route_softmax` (DeepSeek-V2) and `moe.route_sigmoid` (V3), after the gate product
`F.linear(x.float(), gate.float())`; together some fifteen launches in torch.

1. `_gate_logits`: x [T, D] times gate [E, D]^T with float32 accumulation. A decode
   step has a handful of tokens and the gate is up to 256 x 7168, so the work is reading
   the gate: it is cut into tiles of experts and, along D, into splits, enough programs
   to keep every multiprocessor reading. Each split writes its partial logits; the
   second kernel sums them, so there are no atomics and the sum is the same every run.
2. `_route`: one program per few tokens holds their E logits in registers, laid out as
   [tokens, groups, experts of a group] with each dimension padded to a power of two
   (V2's 160 experts are 8 groups of 20), so that group scores are reductions over the
   last axis. Selection is k rounds of argmax, each removing the winner, a score and its
   expert id packed into one int64 so that one reduction finds both; among equal scores
   the lowest id wins (the reference's topk leaves it unspecified).

A single launch would need the whole gate read by each token block's program: one
multiprocessor reading 3.7 MB at T=1, much slower than a second launch.

bf16 x and gate are multiplied in bf16 (products of two bf16 values are exact in
float32, as the reference's float32 product of the upcast values is). A float32 operand
(the checkpoint's gate is kept in float32, kernels/precision.py) takes three TF32 products
on the tensor cores (tf32x3: each operand split into a TF32 part and its remainder), within
a few units of float32's last place, like a different order of the sum: IEEE float32 on the
CUDA cores took 45 us a layer for a 2048-token step on an H200 (1.2 ms of the step); now the
whole routing launch takes 14.8 us (results/kernels/moe-decode-tma-gate-h200.json). (Triton's
interpreter computes in IEEE float32.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.launch import launcher
from preload.kernels.triton_dot import INTERPRETING

# Measured on an H200 inside CUDA graphs, T = 1..512 tokens, D = 2048..7168, E = 64..256.
MIN_SPLIT_D = 64  # the least of D a split covers (one BLOCK_K): 7.5 us at T=1, D=2048 against 13.5 with 256
TARGET_PROGRAMS = 264  # about two per multiprocessor of an H200 (132)
ROUTE_TILE = 256  # logits a routing program holds: one token of V3 or V2, four of V2-Lite
if INTERPRETING:  # which runs programs one after another: fewer, larger ones run faster there
    ROUTE_TILE = 2048
ROUTE_WARPS = 1  # a program's reductions then stay within a warp's shuffles, no shared memory


def _block_e(tokens: int) -> int:
    # Narrow expert tiles spread a few tokens' gate reading over more programs; wide ones
    # read each token block's x fewer times once there are many.
    return 64 if tokens > 64 else 32


@triton.jit
def _gate_logits(
    x_ptr, w_ptr, part_ptr, T, E, D, split_d,
    stride_xt, stride_we, stride_ps,
    DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """part[split, t, e] = sum over this split's slice of D of x[t, d] * w[e, d]."""
    pid_t, pid_e, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    lo = split * split_d
    hi = tl.minimum(lo + split_d, D)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=(t < T)[:, None] & (k < hi)[None, :], other=0.0)
        w = tl.load(w_ptr + e[None, :] * stride_we + k[:, None], mask=(e < E)[None, :] & (k < hi)[:, None], other=0.0)
        acc += tl.dot(a.to(DOT), w.to(DOT), input_precision=PRECISION)
    out = part_ptr + split.to(tl.int64) * stride_ps + t[:, None] * E + e[None, :]
    tl.store(out, acc, mask=(t < T)[:, None] & (e < E)[None, :])


SPAN = tl.constexpr(1 << 16)  # indices a sort key holds (experts, groups)
NONE = tl.constexpr(-(1 << 63))  # the key below every other: no candidate


@triton.jit
def _key(value, index):
    """value (float32, not NaN) and index packed into one int64 that orders by value, then
    by lower index: one max-reduction finds both the best and where it is."""
    bits = value.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits reversed
    return (ordered.to(tl.int64) << 32) + (SPAN - 1) - index.to(tl.int64)


@triton.jit
def _unkey(key):
    """(value, index) of a key."""
    ordered = (key >> 32).to(tl.int32)
    index = (SPAN - 1) - (key - ((key >> 32) << 32)).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), index


@triton.jit
def _max_ge(v):
    """Max over the last two axes of [R, G, J] (the groups, the shorter axis, first)."""
    return tl.max(tl.max(v, 1), 1)


@triton.jit
def _route(
    part_ptr, bias_ptr, weights_ptr, ids_ptr, T, splits, stride_ps, scaling,
    E: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr, GROUPED: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_R: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, K_PAD: tl.constexpr,
):
    """weights, ids [T, TOP_K] from the logits (the sum of `splits` partial [T, E])."""
    GROUP: tl.constexpr = E // N_GROUP
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g, j = tl.arange(0, NG), tl.arange(0, GS)
    expert = g[:, None] * GROUP + j[None, :]  # [NG, GS]: expert id at (group, place in group)
    real = (g[:, None] < N_GROUP) & (j[None, :] < GROUP)
    expert, real = expert[None, :, :], real[None, :, :]
    at = r[:, None, None] * E + expert
    live = (r < T)[:, None, None] & real
    logits = tl.zeros((BLOCK_R, NG, GS), dtype=tl.float32)
    for s in range(splits):
        logits += tl.load(part_ptr + s * stride_ps + at, mask=live, other=0.0)

    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        # The bias steers the choice only; the weights come from the scores.
        choice = scores + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)
    else:
        logits = tl.where(real, logits, float("-inf"))
        p = tl.exp(logits - _max_ge(logits)[:, None, None])
        scores = p / tl.sum(tl.sum(p, 2), 1)[:, None, None]
        choice = scores

    if GROUPED:
        keys = tl.where(real, _key(choice, expert), NONE)
        best = tl.max(keys, 2)
        if SIGMOID:  # noaux_tc: a group scores the sum of its best two
            first = _unkey(best)[1]
            group_score = _unkey(best)[0] + _unkey(tl.max(tl.where(expert == first[:, :, None], NONE, keys), 2))[0]
        else:  # group_limited_greedy: a group scores its best
            group_score = _unkey(best)[0]
        group_keys = tl.where(g[None, :] < N_GROUP, _key(group_score, g[None, :]), NONE)
        keep = g[None, :] < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = g[None, :] == _unkey(tl.max(group_keys, 1))[1][:, None]
            keep = keep | pick
            group_keys = tl.where(pick, NONE, group_keys)
        # Experts of the other groups: V2 fills their scores with 0, V3 with -inf.
        choice = tl.where(keep[:, :, None], choice, float("-inf") if SIGMOID else 0.0)

    keys = tl.where(real, _key(choice, expert), NONE)
    slot = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((BLOCK_R, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_R, K_PAD), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        top, pick = _unkey(_max_ge(keys))
        chosen = expert == pick[:, None, None]
        w = tl.sum(tl.sum(tl.where(chosen & real, scores, 0.0), 2), 1) if SIGMOID else top
        weights = tl.where(slot == i, w[:, None], weights)
        ids = tl.where(slot == i, pick[:, None], ids)
        keys = tl.where(chosen, NONE, keys)

    if RENORM:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    if SIGMOID or not RENORM:  # V2 renormalizes or scales; V3 renormalizes (or not) and scales
        weights = weights * scaling
    out = r[:, None] * TOP_K + slot
    mask = (r < T)[:, None] & (slot < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)


def _check(num_experts: int, top_k: int, n_group: int, topk_group: int, scoring: str, bias) -> None:
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring {scoring!r}: 'softmax' or 'sigmoid'")
    if scoring == "sigmoid" and bias is None:
        raise ValueError("sigmoid routing (noaux_tc) takes the e_score_correction_bias")
    if num_experts % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * num_experts // n_group:
        raise ValueError(f"{num_experts} experts in {n_group} groups, top {topk_group} groups, top {top_k} experts")


def _route_launch(partials: torch.Tensor, bias, top_k: int, n_group: int, topk_group: int, scoring: str,
                  grouped: bool, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    splits, tokens, num_experts = partials.shape
    _check(num_experts, top_k, n_group, topk_group, scoring, bias)
    sigmoid = scoring == "sigmoid"
    grouped = grouped or sigmoid  # noaux_tc always chooses groups first (route_sigmoid)
    if not grouped:
        n_group = topk_group = 1
    ng, gs = triton.next_power_of_2(n_group), triton.next_power_of_2(num_experts // n_group)
    block_r = max(1, min(triton.next_power_of_2(tokens), ROUTE_TILE // (ng * gs)))
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=partials.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=partials.device)
    renorm = norm_topk_prob and (sigmoid or top_k > 1)  # route_softmax renormalizes only more than one
    launcher(_route)[(triton.cdiv(tokens, block_r),)](
        partials, bias.contiguous() if bias is not None else partials, weights, ids, tokens, splits, partials.stride(0), scaling,
        E=num_experts, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        SIGMOID=sigmoid, GROUPED=grouped, RENORM=renorm,
        BLOCK_R=block_r, NG=ng, GS=gs, K_PAD=triton.next_power_of_2(top_k), num_warps=ROUTE_WARPS,
    )
    return weights, ids


def gate_partials(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Partial logits [S, T, E] of x [T, D] and gate [E, D], whose sum over S is
    x.float() @ gate.float().T; S is chosen to spread the gate's reading over the GPU."""
    tokens, d = x.shape
    num_experts = gate.shape[0]
    if gate.shape[1] != d:
        raise ValueError(f"gate {tuple(gate.shape)} for x {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    same = x.dtype == gate.dtype and x.dtype in (torch.bfloat16, torch.float16)
    dot = tl.float32 if INTERPRETING or not same else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    block_k = 64 if dot == tl.float32 else 128
    block_t, block_e = min(64, max(16, triton.next_power_of_2(tokens))), _block_e(tokens)
    tiles = triton.cdiv(tokens, block_t) * triton.cdiv(num_experts, block_e)
    splits = max(1, min(d // MIN_SPLIT_D, triton.cdiv(TARGET_PROGRAMS, tiles)))
    split_d = triton.cdiv(triton.cdiv(d, splits), block_k) * block_k
    splits = triton.cdiv(d, split_d)  # none left empty by the rounding up
    partials = torch.empty(splits, tokens, num_experts, dtype=torch.float32, device=x.device)
    launcher(_gate_logits)[(triton.cdiv(tokens, block_t), triton.cdiv(num_experts, block_e), splits)](
        x, gate, partials, tokens, num_experts, d, split_d, x.stride(0), gate.stride(0), partials.stride(0),
        DOT=dot, PRECISION="ieee" if INTERPRETING or dot != tl.float32 else "tf32x3", BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
    )
    return partials


def fused_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                topk_group: int, scoring: str, grouped: bool, norm_topk_prob: bool,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate product and route_softmax / route_sigmoid in two launches: x [T, D] (bf16
    or float32), gate [E, D], bias [E] (scoring 'sigmoid' only) -> (weights [T, k] float32,
    ids [T, k] int64), as the references return and fused_moe takes them.

    scoring 'softmax' is V2's route_softmax: `grouped` chooses group_limited_greedy (the
    best topk_group of n_group groups, a group scored by its best expert) over greedy.
    'sigmoid' is V3's route_sigmoid (noaux_tc), always grouped, a group scored by its best
    two biased scores. Weights are renormalized and/or scaled exactly as there."""
    return _route_launch(gate_partials(x, gate), bias, top_k, n_group, topk_group, scoring, grouped,
                         norm_topk_prob, scaling)


def fused_route_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                       scoring: str, grouped: bool, norm_topk_prob: bool,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of fused_route from logits [T, E] already computed, in one launch."""
    return _route_launch(logits.float().contiguous()[None], bias, top_k, n_group, topk_group, scoring, grouped,
                         norm_topk_prob, scaling)
