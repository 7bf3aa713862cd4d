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
middle (`latent_attention`) over it; the products with W_uk and W_uv around it
(`per_head`) take head_matvec.py's kernel. `write_latents` stores new tokens' latents in the
cache (on a GPU, cache_write.py). On a GPU both kernels find the cache through `Pools.ptrs`,
its addresses in device memory, not through arguments: a CUDA graph captured against one
cache then serves any other whose addresses are written there.
"""

from typing import NamedTuple

import torch

from preload.kernels.fp8 import FP8, FP8_MAX


class Pools(NamedTuple):
    """One layer of the latent cache: c_kv [S, r] and k_pe [S, dr] per slot, in the
    activations' dtype (scales None) or e4m3 with a float32 scale per row ([S, 1] each);
    on a GPU, `ptrs`: the four tensors' addresses (0 for no scales) as an int64 tensor
    [4] on the device, which is what the kernels read."""

    c_kv: torch.Tensor
    k_pe: torch.Tensor
    c_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    ptrs: torch.Tensor | None = None

    def addresses(self) -> list[int]:
        return [t.data_ptr() if t is not None else 0 for t in (self.c_kv, self.k_pe, self.c_scale, self.k_scale)]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows and their float32 scales [N, 1] (amax / 448), as the fp8 cache stores them."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def write_latents(pools: Pools, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Store the new tokens' c_kv [T, r] and k_pe [T, dr] at their slots [T]: on a GPU in
    one Triton launch (cache_write.py), elsewhere with torch (which autograd can follow)."""
    if c_kv.is_cuda and pools.ptrs is not None:
        from preload.kernels.cache_write import write_latents_triton  # Triton: imported only where there is a GPU

        return write_latents_triton(pools, slots, c_kv, k_pe)
    for pool, scales, x in ((pools.c_kv, pools.c_scale, c_kv), (pools.k_pe, pools.k_scale, k_pe)):
        if scales is None:
            pool[slots] = x.to(pool.dtype)
        else:
            pool[slots], scales[slots] = quantize_rows(x)


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


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, pools: Pools, block_table: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, max_context: int, scale: float) -> torch.Tensor:
    """What the decode kernel computes, by gathering each context: q_lat [B, H, r], q_pe
    [B, H, dr], one layer's pools -> [B, H, r]."""
    c_kv, k_pe, c_scale, k_scale, _ = pools
    slots = paged_slots(block_table, block_size, max_context)
    mask = (torch.arange(max_context, device=q_lat.device) < context_lens[:, None])[:, None]  # [B, 1, K]
    c, k = c_kv[slots], k_pe[slots]
    if c_scale is not None:  # e4m3 rows with a scale each
        c, k = ((x.float() * s[slots]).to(q_lat.dtype) for x, s in ((c, c_scale), (k, k_scale)))
    return latent_attention(q_lat[:, None], q_pe[:, None], c, k, mask, scale)[:, 0]


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, pools: Pools,
               block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int, max_context: int,
               scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence against its cached context: q_nope [B, H, dn], q_pe
    [B, H, dr], absorbed weights (absorbed_weights), one layer's pools. max_context: no
    context is longer (the kernel's split count follows it, the reference's gather width).
    -> [B, H, dv], into `out` if given (rows of a step's attention output: no copy)."""
    q_lat = per_head(q_nope, w_uk.transpose(1, 2))
    if q_lat.is_cuda and pools.ptrs is not None and decode_kernel_takes(q_lat.shape[-1], q_pe.shape[-1]):
        from preload.kernels.mla_decode import mla_decode_latent  # Triton: imported only where there is a GPU

        latent = mla_decode_latent(q_lat.contiguous(), q_pe.contiguous(), pools, block_table, context_lens,
                                   block_size, max_context, scale)
    else:
        latent = mla_decode_reference(q_lat, q_pe, pools, block_table, context_lens, block_size, max_context, scale)
    return per_head(latent, w_uv, out)


def decode_kernel_takes(rank: int, rope: int) -> bool:
    """Whether a GPU's decode attention runs the Triton kernel (mla_decode.py) for latents
    of `rank` and rope parts of `rope` dimensions: its tiles are powers of two, its dot
    products at least 16 deep. The kernel finds the cache through `Pools.ptrs`, so a CUDA
    graph of it serves any later cache; torch's reference, which takes the other shapes,
    reads the pools' own tensors, whose addresses a graph bakes in."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (rank, rope))


def per_head(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, h, n] = sum over k of x[b, h, k] w[h, n, k]: x [B, H, K], w [H, N, K]. On a
    GPU in one Triton launch (head_matvec.py), out contiguous as the attention kernel and the
    output projection read it; or into `out` [B, H, N] (N contiguous) if given."""
    if x.is_cuda and x.stride(-1) == 1:
        from preload.kernels.head_matvec import head_matvec  # Triton: imported only where there is a GPU

        return head_matvec(x, w, out)
    got = torch.einsum("bhk,hnk->bhn", x, w)
    return got if out is None else out.copy_(got)
