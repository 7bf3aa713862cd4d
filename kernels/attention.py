"""Multi-head latent attention (MLA) over a cache of latents.

Each cached token holds only `c_kv` (the normalized latent, kv_lora_rank wide) and
`k_pe` (the roped key part shared by all heads). `kv_b` [H*(dn+dv), r] maps a latent
to per-head key (dn) and value (dv) parts. Two equal ways to attend:

- expanded: map every cached latent to full keys and values, then attend. Cheapest
  when many queries share the context (prefill).
- absorbed: fold kv_b into the query and the output instead, attending over the
  latents directly. Cheapest for one query per sequence (decode).

Shapes: q_nope [B, Q, H, dn], q_pe [B, Q, H, dr], c_kv [B, K, r], k_pe [B, K, dr],
mask [B, Q, K] (True where query q may see key k). Output [B, Q, H, dv].
"""

import torch


def _softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (scores.float() * scale).masked_fill(~mask[:, None], float("-inf"))
    return scores.softmax(dim=-1)


def mla_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    heads, dn = q_nope.shape[2], q_nope.shape[3]
    kv = (c_kv @ kv_b.t()).unflatten(-1, (heads, -1))  # [B, K, H, dn + dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope) + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe)
    probs = _softmax(scores, mask, scale).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    heads, dn = q_nope.shape[2], q_nope.shape[3]
    kv_b = kv_b.unflatten(0, (heads, -1))  # [H, dn + dv, r]
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]
    q_latent = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)
    scores = torch.einsum("bqhr,bkr->bhqk", q_latent, c_kv) + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe)
    probs = _softmax(scores, mask, scale).to(c_kv.dtype)
    out_latent = torch.einsum("bhqk,bkr->bqhr", probs, c_kv)
    return torch.einsum("bqhr,hvr->bqhv", out_latent, w_uv)
