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

`mla_decode` is the decode step over the paged cache itself (one query per sequence):
on a GPU the Triton kernel of mla_decode.py reads the cache through the block tables;
elsewhere its reference gathers each sequence's context and runs the absorbed form's
middle (`latent_attention`) over it.
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


def absorbed_weights(kv_b: torch.Tensor, heads: int, dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [H*(dn+dv), r] as W_uk [H, dn, r] (folded into the query) and W_uv [H, dv, r]
    (into the output)."""
    kv_b = kv_b.unflatten(0, (heads, -1))
    return kv_b[:, :dn], kv_b[:, dn:]


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The absorbed form between its two weights: queries q_lat [B, Q, H, r] (q_nope W_uk)
    and q_pe against the latents, out the softmax-weighted latents [B, Q, H, r]."""
    scores = torch.einsum("bqhr,bkr->bhqk", q_lat, c_kv) + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe)
    probs = _softmax(scores, mask, scale).to(c_kv.dtype)
    return torch.einsum("bhqk,bkr->bqhr", probs, c_kv)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    w_uk, w_uv = absorbed_weights(kv_b, q_nope.shape[2], q_nope.shape[3])
    q_lat = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)
    return torch.einsum("bqhr,hvr->bqhv", latent_attention(q_lat, q_pe, c_kv, k_pe, mask, scale), w_uv)


def paged_slots(block_table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Cache slots of positions 0 .. length-1 of each sequence [B, length], from its blocks."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table.long()[:, :, None] * block_size + offsets).flatten(1)[:, :length]


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, pools: tuple, block_table: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, max_context: int, scale: float) -> torch.Tensor:
    """What the decode kernel computes, by gathering each context: q_lat [B, H, r], q_pe
    [B, H, dr], pools as for `mla_decode` -> [B, H, r]."""
    c_kv, k_pe, c_scale, k_scale = pools
    slots = paged_slots(block_table, block_size, max_context)
    mask = (torch.arange(max_context, device=q_lat.device) < context_lens[:, None])[:, None]  # [B, 1, K]
    c, k = c_kv[slots], k_pe[slots]
    if c_scale is not None:  # e4m3 rows with a scale each
        c, k = ((x.float() * s[slots]).to(q_lat.dtype) for x, s in ((c, c_scale), (k, k_scale)))
    return latent_attention(q_lat[:, None], q_pe[:, None], c, k, mask, scale)[:, 0]


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, pools: tuple,
               block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int, max_context: int,
               scale: float) -> torch.Tensor:
    """One new token per sequence against its cached context: q_nope [B, H, dn], q_pe
    [B, H, dr], absorbed weights (absorbed_weights), pools = (c_kv, k_pe, c_kv scales or
    None, k_pe scales or None) of one layer. -> [B, H, dv]."""
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    rank, rope = q_lat.shape[-1], q_pe.shape[-1]
    # Triton's tiles are powers of two, and its dot products at least 16 deep.
    if q_lat.is_cuda and all(n >= 16 and n & (n - 1) == 0 for n in (rank, rope)):
        from preload.kernels.mla_decode import mla_decode_latent  # Triton: imported only where there is a GPU

        out = mla_decode_latent(q_lat.contiguous(), q_pe.contiguous(), *pools, block_table, context_lens, block_size,
                                max_context, scale)
    else:
        out = mla_decode_reference(q_lat, q_pe, pools, block_table, context_lens, block_size, max_context, scale)
    return torch.einsum("bhr,hvr->bhv", out, w_uv)
