"""The latent KV cache and the per-step attention layout over it.

MLA caches two small vectors per token per layer: the normalized latent `c_kv`
(kv_lora_rank) and the roped shared key `k_pe` (qk_rope_head_dim). The cache is a
pool of token slots; which slots hold which sequence is the caller's business (the
engine's block manager, or a simple contiguous range).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preload.kernels.fp8 import FP8, FP8_MAX
from preload.checkpoint.config import ModelConfig


def bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if kv_cache_dtype == "fp8":
        return num_layers * (width + 2 * 4)  # e4m3 values and one float32 scale per vector
    return num_layers * width * dtype.itemsize


def worker_reserve(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """Device memory a worker needs besides its KV cache: about 1 GiB of CUDA context,
    kernels and library workspaces, plus the largest step's activations, dominated by
    float32 logits and their log-softmax when a prompt is scored on every row."""
    return (1 << 30) + max_num_batched_tokens * (8 * cfg.vocab_size + 64 * cfg.hidden_size)


def kv_cache_share(cfg: ModelConfig, device: torch.device, weight_bytes: int, max_num_batched_tokens: int,
                   workers: int, spares: int, utilization: float) -> int:
    """Bytes of KV cache for one of `workers` engines that share one GPU and the
    daemon's weights: the weights count once, each worker and spare keeps its reserve,
    the rest of `utilization` x the device is split evenly. Never more than is free now."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = worker_reserve(cfg, max_num_batched_tokens)
    share = int((utilization * total - weight_bytes - (workers + spares) * reserve) / workers)
    budget = min(share, free - reserve)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no room for a KV cache on {device}: {utilization:.0%} of {total / gib:.1f} GiB less {weight_bytes / gib:.1f} GiB"
            f" of weights and {workers + spares} x {reserve / gib:.1f} GiB of worker reserve leaves {share / gib:.2f} GiB"
            f" per worker; {free / gib:.1f} GiB is free now. Lower --workers or --spare-workers, or set --kv-cache-memory"
        )
    return budget


class LatentCache:
    """Per-layer slot pools. With kv_cache_dtype "fp8" each cached vector is stored in
    e4m3 with its own float32 scale (per token), and dequantized when read."""

    def __init__(self, num_layers: int, num_slots: int, cfg: ModelConfig, dtype: torch.dtype, device, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")
        self.dtype, self.fp8 = dtype, kv_cache_dtype == "fp8"
        store = FP8 if self.fp8 else dtype

        def pools(width: int, dtype: torch.dtype) -> list[torch.Tensor]:
            # One tensor per layer, so that training can write them under autograd.
            return [torch.zeros(num_slots, width, dtype=dtype, device=device) for _ in range(num_layers)]

        self.c_kv, self.k_pe = pools(cfg.kv_lora_rank, store), pools(cfg.qk_rope_head_dim, store)
        if self.fp8:
            self.c_kv_scale, self.k_pe_scale = pools(1, torch.float32), pools(1, torch.float32)

    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        if self.fp8:
            for pool, scales, x in ((self.c_kv, self.c_kv_scale, c_kv), (self.k_pe, self.k_pe_scale, k_pe)):
                scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
                pool[layer][slots] = (x.float() / scale).to(FP8)
                scales[layer][slots] = scale
            return
        self.c_kv[layer][slots] = c_kv.to(self.dtype)
        self.k_pe[layer][slots] = k_pe.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp8:
            return tuple(
                (pool[layer][slots].float() * scales[layer][slots]).to(self.dtype)
                for pool, scales in ((self.c_kv, self.c_kv_scale), (self.k_pe, self.k_pe_scale))
            )
        return self.c_kv[layer][slots], self.k_pe[layer][slots]


@dataclass
class AttentionMeta:
    """Where one forward step's tokens sit: a flat batch of T new tokens from B
    sequences, each attending to its own context of cached slots.

    positions [T], slots [T]: position and cache slot of each new token.
    q_index [B, Q], q_valid [B, Q]: the flat index of each sequence's new tokens, padded.
    kv_slots [B, K]: each sequence's context slots (new tokens included), padded.
    mask [B, Q, K]: causal visibility, False on padding keys.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    q_index: torch.Tensor
    q_valid: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return self.q_index.shape[1] == 1

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, torch.Tensor]], device) -> AttentionMeta:
        """seqs: (start, n_new, context_slots) per sequence; the new tokens are at
        positions start .. start+n_new-1 and context_slots covers 0 .. start+n_new-1."""
        starts = torch.tensor([s for s, _, _ in seqs], device=device)
        counts = torch.tensor([n for _, n, _ in seqs], device=device)
        ctx_lens = starts + counts
        q, k = int(counts.max()), int(ctx_lens.max())
        offsets = torch.cumsum(counts, 0) - counts
        qi = torch.arange(q, device=device)
        q_valid = qi < counts[:, None]
        q_index = torch.where(q_valid, offsets[:, None] + qi, 0)
        kv_slots = torch.zeros(len(seqs), k, dtype=torch.long, device=device)
        for row, (_, _, ctx) in zip(kv_slots, seqs):
            row[: len(ctx)] = torch.as_tensor(ctx, device=device)
        q_pos = starts[:, None] + qi  # padded queries get later positions: never an empty row
        k_pos = torch.arange(k, device=device)
        mask = (k_pos <= q_pos[:, :, None]) & (k_pos < ctx_lens[:, None, None])
        positions = q_pos[q_valid]
        slots = kv_slots.gather(1, q_pos.clamp(max=k - 1))[q_valid]
        return cls(positions, slots, q_index, q_valid, kv_slots, mask)
