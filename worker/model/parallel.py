"""Tensor and expert parallelism: one model computed by a group of processes, each holding
a shard of its weights, their partial sums added by an all-reduce (torch.distributed:
gloo on CPUs, NCCL on GPUs).

How the model is cut, as the DeepSeek models' reference code and the fast engines cut it:
- attention by heads: each rank the queries, the latent up-projection (kv_b) and the
  output projection's columns of heads [h0, h1); the latent cache is the same on every
  rank (one latent per token, shared by the heads), and so is its input projection;
- dense feed-forward layers and the shared experts by the intermediate dimension: gate
  and up by rows, down by columns;
- routed experts: whole experts by rank with expert parallelism (each rank the experts
  [e0, e1), the others skipped), else each expert cut as a dense layer;
- the rest (embedding, norms, router, output head) whole on every rank.
Each layer then ends in two all-reduces (after attention's output projection, after the
feed-forward); every rank holds the whole residual stream and computes the same logits,
so that each samples the same tokens and the group steps in lock-step.

`shard` cuts a name -> tensor mapping into views (no copy) of one rank's part, so that a
worker attached to the daemon's arena maps the whole and uses its share.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from preload.checkpoint.config import ModelConfig
from preload.kernels.quant import BLOCK

SCALE = "_scale_inv"  # a quantized matrix's block scales: "<name>_scale_inv" beside "<name>"


@dataclass(frozen=True)
class Ranks:
    """This process's place in its group: `rank` of `size`; `expert_parallel`: routed
    experts split whole between the ranks rather than each cut."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of every rank's `x` (in place), or `x` alone."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def part(self, n: int, what: str) -> slice:
        """This rank's share of `n` (heads, experts, rows), which the group must divide."""
        if n % self.size:
            raise ValueError(f"{what}: {n} cannot be split between {self.size} ranks")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def owns_expert(self, e: int, n_experts: int) -> bool:
        """Whether routed expert `e` of `n_experts` is this rank's (every one, without expert parallelism)."""
        return not self.expert_parallel or e in range(n_experts)[self.part(n_experts, "routed experts")]


def rank_config(cfg: ModelConfig, ranks: Ranks) -> ModelConfig:
    """The model as one rank sees it: its heads."""
    heads = ranks.part(cfg.num_heads, "attention heads")
    return replace(cfg, num_heads=heads.stop - heads.start)


ATTENTION = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.weight$")
FEED_FORWARD = re.compile(r"\.mlp\.(?:shared_experts\.|experts\.(\d+)\.)?(gate_proj|up_proj|down_proj)\.weight$")


def shard(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], ranks: Ranks) -> Mapping[str, torch.Tensor]:
    """One rank's weights: views of `weights`, cut as the module docstring says (the
    routed experts other ranks own left out); alone, `weights` itself."""
    if ranks.size == 1:
        return weights
    out = {}
    for name, t in weights.items():
        base = name.removesuffix(SCALE)
        if (m := ATTENTION.search(base)) is not None:
            width = {"o_proj": cfg.v_head_dim, "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim}.get(
                m.group(1), cfg.qk_head_dim)
            heads = ranks.part(cfg.num_heads, "attention heads")
            dim, rows = int(m.group(1) == "o_proj"), slice(heads.start * width, heads.stop * width)
        elif (m := FEED_FORWARD.search(base)) is not None:
            expert = m.group(1)
            if expert is not None and ranks.expert_parallel:
                if ranks.owns_expert(int(expert), cfg.n_routed_experts):
                    out[name] = t
                continue
            dim = int(m.group(2) == "down_proj")
            rows = ranks.part(weights[base].shape[dim], f"{base}'s intermediate dimension")
        else:
            out[name] = t
            continue
        out[name] = cut(t, rows, dim, scale=base != name, what=base)
    return out


def cut(t: torch.Tensor, rows: slice, dim: int, scale: bool, what: str) -> torch.Tensor:
    """`t`'s rows (dim 0) or columns (dim 1) `rows`; for block scales, the blocks of those
    (the cut must fall on a block's edge)."""
    if scale:
        if rows.start % BLOCK or rows.stop % BLOCK:
            raise ValueError(f"{what}: a shard of [{rows.start}, {rows.stop}) does not fall on {BLOCK}-wide blocks")
        rows = slice(rows.start // BLOCK, -(-rows.stop // BLOCK))
    return t[rows] if dim == 0 else t[:, rows]
