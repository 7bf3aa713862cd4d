"""The DeepSeek V2/V3 model: MLA attention, dense and MoE SwiGLU layers, the MTP module.

The model owns no weights: it holds references into a name -> tensor mapping (a
checkpoint read into memory, or an arena attached zero-copy), with the names of the
HF checkpoint. It runs on a flat batch of tokens from many sequences; attention
reads each sequence's context from a latent cache (see `kv_cache.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.shapes import mtp_layer_index
from preload.kernels.attention import Pools, absorbed_weights, mla_decode, mla_expanded
from preload.kernels.linear import dense, linear, linear_weight
from preload.kernels.moe import moe_layer, route, swiglu
from preload.kernels.norm import add_rms_norm, rms_norm
from preload.kernels.quant import BLOCK, Weight
from preload.kernels.rope import rope_frequencies, rope_qk, softmax_scale
from preload.worker.model.kv_cache import AttentionMeta, LatentCache
from preload.worker.model.parallel import Ranks

Weights = Mapping[str, torch.Tensor]
Rope = tuple[torch.Tensor, float]  # the rotary inverse frequencies (on the model's device) and YaRN's scale


def _proj(cfg: ModelConfig, w: Weights, name: str) -> Weight:
    # Quantized matrices carry block scales; DeepSeek's checkpoints and our fp8_block
    # mode both use 128x128 blocks unless a native checkpoint says otherwise.
    return linear_weight(w, name, cfg.fp8_block or BLOCK)


@dataclass
class MLP:
    """SwiGLU feed-forward: a dense layer, one routed expert or the shared experts."""

    gate: Weight
    up: Weight
    down: Weight

    @classmethod
    def load(cls, cfg: ModelConfig, w: Weights, p: str) -> MLP:
        return cls(*(_proj(cfg, w, f"{p}.{part}_proj.weight") for part in ("gate", "up", "down")))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate, self.up, self.down)


class MoE:
    """Routed experts (top-k of n per token) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig, w: Weights, p: str, ranks: Ranks):
        self.cfg = cfg
        self.gate = w[f"{p}.gate.weight"]
        self.bias = w.get(f"{p}.gate.e_score_correction_bias")
        n = cfg.n_routed_experts  # (None: another rank's, parallel.py)
        self.experts = [MLP.load(cfg, w, f"{p}.experts.{e}") if ranks.owns_expert(e, n) else None for e in range(n)]
        self.shared = MLP.load(cfg, w, f"{p}.shared_experts") if cfg.n_shared_experts else None
        self._stacked: tuple | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return route(x, self.gate, self.bias, c.num_experts_per_tok, c.n_group, c.topk_group, c.scoring_func,
                     c.topk_method == "group_limited_greedy", c.norm_topk_prob, c.routed_scaling_factor)

    def stacked(self) -> tuple:
        """Every expert's gate, up and down as one [E, ...] view each (the GPU kernels' form);
        made on first use, views of the arena where the experts lie evenly spaced in it."""
        if self._stacked is None:
            from preload.kernels.fused_moe import stack_experts

            self._stacked = tuple(stack_experts([getattr(e, part) for e in self.experts]) for part in ("gate", "up", "down"))
        return self._stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        shared = (self.shared.gate, self.shared.up, self.shared.down) if self.shared else None
        return moe_layer(x, ids, weights, self.experts, self.stacked, shared)


def paged_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b: torch.Tensor, pools: Pools, meta: AttentionMeta,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """A step's attention over the paged cache itself -> [T, H, dv]: its decode rows (the
    first meta.decode_rows, one token of a sequence each) in the absorbed form, kv_b folded
    into the query and the output (mla_decode); the others, prompts' chunks, in the expanded
    form, flash-style a chunk of context at a time (mla_prefill: Triton, so on a GPU or in
    Triton's interpreter). Expanded, a decode row's every context token would be
    up-projected for its one query. `out`: where to write it (a step replayed from CUDA
    graphs reads it from there), else a new tensor."""
    heads, dn = q_nope.shape[1], q_nope.shape[2]
    d = meta.decode_rows

    def absorbed(rows: int, into: torch.Tensor | None = None) -> torch.Tensor:
        return mla_decode(q_nope[:rows], q_pe[:rows], *absorbed_weights(kv_b, heads, dn), pools, meta.block_table[:rows],
                          meta.context_lens[:rows], meta.block_size, meta.decode_context, scale, into)

    if d == q_nope.shape[0]:
        return absorbed(d, out)
    if out is None:
        out = q_nope.new_empty(q_nope.shape[0], heads, kv_b.shape[0] // heads - dn)
    from preload.kernels.mla_prefill import mla_prefill  # Triton: imported only where it runs

    if d:
        absorbed(d, out[:d])
    p = meta.prompts
    mla_prefill(q_nope[d:], q_pe[d:], kv_b, pools, p.block_table, p.context_lens, p.q_starts, meta.block_size,
                p.max_context, p.max_q, scale, out=out[d:], context_tokens=p.context_tokens, plan=meta.prefill_plan)
    return out


class Attention:
    """Multi-head latent attention: queries (optionally through a low-rank q_lora),
    one shared latent c_kv + roped k_pe per token, cached and attended to."""

    def __init__(self, cfg: ModelConfig, w: Weights, p: str, layer: int):
        self.cfg, self.layer = cfg, layer
        if cfg.q_lora_rank:
            self.q_a = _proj(cfg, w, f"{p}.q_a_proj.weight")
            self.q_a_norm = w[f"{p}.q_a_layernorm.weight"]
            self.q_b = _proj(cfg, w, f"{p}.q_b_proj.weight")
        else:
            self.q = _proj(cfg, w, f"{p}.q_proj.weight")
        self.kv_a = _proj(cfg, w, f"{p}.kv_a_proj_with_mqa.weight")
        self.kv_a_norm = w[f"{p}.kv_a_layernorm.weight"]
        self.kv_b = _proj(cfg, w, f"{p}.kv_b_proj.weight")
        self.o = _proj(cfg, w, f"{p}.o_proj.weight")
        self.scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        self._kv_b: torch.Tensor | None = None

    def kv_b_dense(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b in the activations' dtype: the stored matrix, or (fp8) dequantized once."""
        if self._kv_b is None:
            self._kv_b = dense(self.kv_b, dtype)
        return self._kv_b

    def project(self, x: torch.Tensor, rope: Rope, positions: torch.Tensor, slots: torch.Tensor,
                cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (q_nope [T, H, dn], roped q_pe [T, H, dr]) of x [T, D], its latents
        written to the cache at `slots`: all of attention that is not the attending."""
        c = self.cfg
        if c.q_lora_rank:
            q = linear(rms_norm(linear(x, self.q_a), self.q_a_norm, c.rms_norm_eps), self.q_b)
        else:
            q = linear(x, self.q)
        q_nope, q_pe = q.unflatten(-1, (c.num_heads, c.qk_head_dim)).split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        c_kv, k_pe = linear(x, self.kv_a).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        c_kv = rms_norm(c_kv, self.kv_a_norm, c.rms_norm_eps)
        q_pe, k_pe = rope_qk(q_pe, k_pe, positions, *rope, c.rope.interleaved)
        cache.write(self.layer, slots, c_kv, k_pe)
        return q_nope, q_pe

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMeta, cache: LatentCache,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output [T, H * dv], before the output projection (into `out`, [T, H,
        dv], if given: a prompt step's captured pieces read it there, prompt_graphs.py)."""
        if meta.is_decode or q_nope.is_cuda:
            out = paged_attention(q_nope, q_pe, self.kv_b_dense(q_nope.dtype), cache.pools(self.layer), meta,
                                  self.scale, out)
            return out.flatten(1)
        # The CPU's (and training's, which autograd follows) form: gather each context, mask [B, Q, K].
        ctx_c_kv, ctx_k_pe = cache.read(self.layer, meta.kv_slots)
        got = mla_expanded(q_nope[meta.q_index], q_pe[meta.q_index], ctx_c_kv, ctx_k_pe, self.kv_b_dense(q_nope.dtype),
                           meta.mask, self.scale)[meta.q_valid]
        return got.flatten(1) if out is None else out.copy_(got).flatten(1)


class Block:
    """Pre-norm decoder layer: x + attention(norm x), then x + feed-forward(norm x)."""

    def __init__(self, cfg: ModelConfig, w: Weights, layer: int, ranks: Ranks = Ranks()):
        p = f"model.layers.{layer}"
        self.eps, self.reduce = cfg.rms_norm_eps, ranks.all_reduce  # (the sum of the group's partial sums)
        self.attn_norm = w[f"{p}.input_layernorm.weight"]
        self.attn = Attention(cfg, w, f"{p}.self_attn", layer)
        self.ffn_norm = w[f"{p}.post_attention_layernorm.weight"]
        self.ffn = MoE(cfg, w, f"{p}.mlp", ranks) if cfg.is_moe_layer(layer) else MLP.load(cfg, w, f"{p}.mlp")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMeta,
                cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(feed-forward output, residual stream before it): their sum is the layer's output,
        which the next layer's first norm adds up itself (one launch for the add and the norm);
        residual None: x is the stream itself (the first layer)."""
        q_nope, q_pe, residual = self.before_attention(x, residual, rope, meta.positions, meta.slots, cache)
        return self.after_attention(self.attn.attend(q_nope, q_pe, meta, cache), residual)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, positions: torch.Tensor,
                         slots: torch.Tensor, cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attending: (q_nope, q_pe, residual stream), the latents cached."""
        if residual is None:
            h, residual = rms_norm(x, self.attn_norm, self.eps), x
        else:
            h, residual = add_rms_norm(x, residual, self.attn_norm, self.eps)
        return *self.attn.project(h, rope, positions, slots, cache), residual

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from the attention's output [T, H * dv] on: (feed-forward output, residual)."""
        h, residual = add_rms_norm(self.reduce(linear(attended, self.attn.o)), residual, self.ffn_norm, self.eps)
        return self.reduce(self.ffn(h)), residual

    def __call__(self, x: torch.Tensor, rope: Rope, meta: AttentionMeta, cache: LatentCache) -> torch.Tensor:
        out, residual = self.forward(x, None, rope, meta, cache)
        return out + residual


class MTP:
    """DeepSeek-V3's multi-token prediction module: from the main model's hidden state
    at position i and the embedding of token i+1, predict token i+2."""

    def __init__(self, cfg: ModelConfig, w: Weights, ranks: Ranks):
        m = mtp_layer_index(cfg)
        p = f"model.layers.{m}"
        self.eps = cfg.rms_norm_eps
        self.enorm, self.hnorm = w[f"{p}.enorm.weight"], w[f"{p}.hnorm.weight"]
        self.eh_proj = w[f"{p}.eh_proj.weight"]
        self.block = Block(cfg, w, m, ranks)
        self.norm = w[f"{p}.shared_head.norm.weight"]


class Transformer:
    """Embedding, decoder blocks, final norm and output head (plus the MTP module when
    the checkpoint has one). With `ranks` of a group: one rank's share (parallel.py), its
    `cfg` and `weights` that rank's (rank_config, shard)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, ranks: Ranks = Ranks()):
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]
        self.layers = [Block(cfg, weights, i, ranks) for i in range(cfg.num_layers)]
        self.norm = weights["model.norm.weight"]
        self.head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        has_mtp = cfg.num_mtp_layers > 0 and f"model.layers.{mtp_layer_index(cfg)}.eh_proj.weight" in weights
        self.mtp = MTP(cfg, weights, ranks) if has_mtp else None
        inv_freq, self.rope_scale = rope_frequencies(cfg.rope, cfg.qk_rope_head_dim)
        self.inv_freq = inv_freq.to(self.embed.device)  # once: a copy from the host in a step would wait for the device

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_layers + (1 if self.mtp else 0)

    @property
    def rope(self) -> Rope:
        return self.inv_freq, self.rope_scale

    def forward(self, tokens: torch.Tensor, meta: AttentionMeta, cache: LatentCache) -> torch.Tensor:
        """Final-normed hidden states [T, D] for a flat batch of tokens [T]."""
        x, residual = self.embed[tokens], None
        for block in self.layers:
            x, residual = block.forward(x, residual, self.rope, meta, cache)
        return add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head).float()

    def mtp_forward(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, meta: AttentionMeta, cache: LatentCache
    ) -> torch.Tensor:
        """MTP logits [T, V]: hidden [T, D] from `forward` at positions i, next_tokens [T] the tokens at i+1."""
        return self.mtp_step(hidden, next_tokens, meta, cache)[1]

    def mtp_step(self, hidden: torch.Tensor, next_tokens: torch.Tensor, meta: AttentionMeta,
                 cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MTP block's output [T, D], its logits [T, V]); the output may stand in for
        `hidden` at the next position, to draft a further token (speculative.py)."""
        m = self.mtp
        assert m is not None, "this checkpoint has no MTP layer"
        e = rms_norm(self.embed[next_tokens], m.enorm, m.eps)
        h = rms_norm(hidden, m.hnorm, m.eps)
        x = m.block(F.linear(torch.cat([e, h], dim=-1), m.eh_proj), self.rope, meta, cache)
        return x, self.logits(rms_norm(x, m.norm, m.eps))
