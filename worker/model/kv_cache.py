"""The latent KV cache and the per-step attention layout over it.

MLA caches two small vectors per token per layer: the normalized latent `c_kv`
(kv_lora_rank) and the roped shared key `k_pe` (qk_rope_head_dim). The cache is a
pool of token slots; which slots hold which sequence is the caller's business (the
engine's block manager: a sequence's blocks are its block table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from preload.checkpoint.config import ModelConfig
from preload.kernels.attention import Pools, paged_slots, write_latents
from preload.kernels.fp8 import FP8
from preload.kernels.prefill import PrefillPlan, prefill_plan
from preload.worker.model.host_values import to_device


def bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if kv_cache_dtype == "fp8":
        return num_layers * (width + 2 * 4)  # e4m3 values and one float32 scale per vector
    return num_layers * width * dtype.itemsize


DAEMON_CONTEXT_BYTES = 640 << 20  # the daemon's own CUDA context (612 MiB measured on an H200, CUDA 13)


def worker_reserve(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """Device memory a worker needs besides its KV cache: 2 GiB of CUDA context, kernels,
    library workspaces, captured decode and prompt graphs and allocator slack (bundled
    model: 1.46 GiB measured on an H200 before prompt steps had graphs; 1.90 GiB on an H100
    since, a worker or a spare alike: 7,328 MiB with 5,383 of KV, a spare 1,920), plus the
    largest step's activations, dominated by float32 logits and their log-softmax when a
    prompt is scored on every row."""
    return (1 << 31) + max_num_batched_tokens * (8 * cfg.vocab_size + 64 * cfg.hidden_size)


def kv_cache_share(cfg: ModelConfig, device: torch.device, weight_bytes: int, max_num_batched_tokens: int,
                   workers: int, spares: int, utilization: float) -> int:
    """Bytes of KV cache for one of `workers` engines that share one GPU and the
    daemon's weights: the weights and the daemon's context count once, each worker and
    spare keeps its reserve, the rest of `utilization` x the device is split evenly.
    Never more than is free now."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = worker_reserve(cfg, max_num_batched_tokens)
    share = int((utilization * total - weight_bytes - DAEMON_CONTEXT_BYTES - (workers + spares) * reserve) / workers)
    budget = min(share, free - reserve)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no room for a KV cache on {device}: {utilization:.0%} of {total / gib:.1f} GiB less {weight_bytes / gib:.1f} GiB"
            f" of weights and {workers + spares} x {reserve / gib:.1f} GiB of worker reserve leaves {share / gib:.2f} GiB"
            f" per worker; {free / gib:.1f} GiB is free now. Lower --workers or --spare-workers, or set --kv-cache-memory"
        )
    return budget


class CacheMemory:
    """Pools cut one after another from one flat buffer (ipc.kv_memory.KvMemory), each
    at an aligned offset. A fresh buffer is zeroed already; one a worker of the same slot
    used before holds stale, finite latents in slots no sequence of ours has written."""

    ALIGN = 256

    def __init__(self, memory):
        self.memory, self.at = memory, 0

    @classmethod
    def aligned(cls, n: int) -> int:
        return -(-n // cls.ALIGN) * cls.ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if self.at + n > self.memory.size:
            raise ValueError(f"KV memory of {self.memory.size} bytes is too small: {self.at + n} needed so far")
        view = self.memory.tensor[self.at : self.at + n].view(dtype).view(shape)
        self.at += self.aligned(n)
        return view


class LatentCache:
    """Per-layer slot pools. With kv_cache_dtype "fp8" each cached vector is stored in
    e4m3 with its own float32 scale (per token), and dequantized when read.

    On a GPU the pools' addresses are also kept on the device (`ptrs`, [layers, 4] int64),
    where the kernels read them. A caller that captures CUDA graphs passes its own `ptrs`
    tensor, so that a new cache (a worker's real one after its warm-up) only rewrites the
    addresses the graphs read."""

    def __init__(self, num_layers: int, num_slots: int, cfg: ModelConfig, dtype: torch.dtype, device,
                 kv_cache_dtype: str = "auto", ptrs: torch.Tensor | None = None, memory: CacheMemory | None = None):
        """`memory`: where the pools are cut from (a supervised worker's KV memory, which
        its slot's next worker maps again); else each pool is its own zeroed tensor."""
        self.dtype, self.fp8 = dtype, kv_cache_dtype == "fp8"
        shapes = self.pool_shapes(num_layers, num_slots, cfg, dtype, kv_cache_dtype)
        # One tensor per layer, so that training can write them under autograd.
        made = [[memory.take(shape, dt) if memory is not None else torch.zeros(shape, dtype=dt, device=device)
                 for _ in range(num_layers)] for shape, dt in shapes]
        none = [None] * num_layers
        self.c_kv, self.k_pe, self.c_kv_scale, self.k_pe_scale = made if self.fp8 else (*made, none, none)
        self.ptrs = None
        if torch.device(device).type == "cuda":
            self.ptrs = ptrs if ptrs is not None else torch.empty(num_layers, 4, dtype=torch.long, device=device)
            addresses = [Pools(*layer).addresses() for layer in zip(self.c_kv, self.k_pe, self.c_kv_scale, self.k_pe_scale)]
            # (the kernels that read these are told so: tl.multiple_of in mla_decode.py, cache_write.py)
            assert all(a % 16 == 0 for layer in addresses for a in layer), "a KV pool not 16-byte aligned"
            self.ptrs.copy_(torch.tensor(addresses, dtype=torch.long))

    @staticmethod
    def pool_shapes(num_layers: int, num_slots: int, cfg: ModelConfig, dtype: torch.dtype,
                    kv_cache_dtype: str) -> list[tuple[tuple[int, int], torch.dtype]]:
        """(shape, dtype) of each kind of pool, one of each per layer: c_kv, k_pe, and
        with an fp8 cache their scales."""
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")
        store = FP8 if kv_cache_dtype == "fp8" else dtype
        shapes = [((num_slots, cfg.kv_lora_rank), store), ((num_slots, cfg.qk_rope_head_dim), store)]
        return shapes + ([((num_slots, 1), torch.float32)] * 2 if kv_cache_dtype == "fp8" else [])

    @classmethod
    def nbytes(cls, num_layers: int, num_slots: int, cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str) -> int:
        """Bytes of CacheMemory the pools take, alignment included."""
        shapes = cls.pool_shapes(num_layers, num_slots, cfg, dtype, kv_cache_dtype)
        return num_layers * sum(CacheMemory.aligned(math.prod(shape) * dt.itemsize) for shape, dt in shapes)

    def pools(self, layer: int) -> Pools:
        """One layer's pools, as the attention kernels take them."""
        ptrs = self.ptrs[layer] if self.ptrs is not None else None
        return Pools(self.c_kv[layer], self.k_pe[layer], self.c_kv_scale[layer], self.k_pe_scale[layer], ptrs)

    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        write_latents(self.pools(layer), slots, c_kv, k_pe)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp8:
            return tuple(
                (pool[layer][slots].float() * scales[layer][slots]).to(self.dtype)
                for pool, scales in ((self.c_kv, self.c_kv_scale), (self.k_pe, self.k_pe_scale))
            )
        return self.c_kv[layer][slots], self.k_pe[layer][slots]


class PromptRows(NamedTuple):
    """The rows of a step past its decode rows, as the prefill kernel takes them: their
    sequences' block tables and context lengths, where each one's new tokens begin among
    these rows [B' + 1], the longest context, the most new tokens, all contexts' tokens."""

    block_table: torch.Tensor
    context_lens: torch.Tensor
    q_starts: torch.Tensor
    max_context: int
    max_q: int
    context_tokens: int


@dataclass
class AttentionMeta:
    """Where one forward step's tokens sit: a flat batch of T new tokens from B
    sequences, each attending to its context in the paged latent cache.

    positions [T], slots [T]: position and cache slot of each new token.
    q_starts [B + 1]: sequence b's new tokens are rows q_starts[b] .. q_starts[b+1]-1.
    context_tokens: the contexts' lengths summed, on the host (the chunked prefill's count).
    block_table [B, NB] (int32): each sequence's cache blocks, block_size slots each.
    context_lens [B] (int32): tokens in each context, the new ones included.
    starts [B]: the position of each sequence's first new token.
    decode_rows: how many sequences at the head of the batch have one new token each
    (the engine puts them first): attention takes those rows in the absorbed form over
    the cache (a decode step's kernel), the others in the expanded one (prefill's); their
    longest context is decode_context, and `prompts` describes the others.
    q_index [B, Q], q_valid [B, Q], kv_slots [B, K], mask [B, Q, K]: the new tokens'
    flat indices (padded), the contexts as slots and their causal visibility, for the
    attention that gathers each context (the CPU's); made on first use.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    q_starts: torch.Tensor
    context_tokens: int
    block_table: torch.Tensor
    context_lens: torch.Tensor
    starts: torch.Tensor
    block_size: int
    max_q: int
    max_context: int
    decode_rows: int
    decode_context: int
    prompt_lens: tuple[int, ...] = ()  # the host's copy of the context lengths past the decode rows
    prompt_max_q: int = 0

    @property
    def is_decode(self) -> bool:
        return self.max_q == 1

    @cached_property
    def prompts(self) -> PromptRows:
        d = self.decode_rows
        return PromptRows(self.block_table[d:], self.context_lens[d:], self.q_starts[d:] - d, max(self.prompt_lens),
                          self.prompt_max_q, sum(self.prompt_lens))

    @cached_property
    def prefill_plan(self) -> PrefillPlan:
        """The chunked prefill's plan of the rows past the decode rows, made at the first
        layer's attention and taken by every layer's."""
        p = self.prompts
        return prefill_plan(p.block_table, p.context_lens, p.q_starts, self.block_size, p.max_context,
                            p.context_tokens)

    @cached_property
    def q_valid(self) -> torch.Tensor:
        counts = self.q_starts[1:] - self.q_starts[:-1]
        return torch.arange(self.max_q, device=counts.device) < counts[:, None]

    @cached_property
    def q_index(self) -> torch.Tensor:
        flat = self.q_starts[:-1, None] + torch.arange(self.max_q, device=self.q_starts.device)
        return torch.where(self.q_valid, flat, 0)

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        return paged_slots(self.block_table, self.block_size, self.max_context)

    @cached_property
    def mask(self) -> torch.Tensor:
        q_pos = self.starts[:, None] + torch.arange(self.max_q, device=self.starts.device)  # padding sees more: never empty
        k_pos = torch.arange(self.max_context, device=self.starts.device)
        return (k_pos <= q_pos[:, :, None]) & (k_pos < self.context_lens[:, None, None])

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, list[int]]], block_size: int, device) -> AttentionMeta:
        """seqs: (start, n_new, blocks) per sequence: the new tokens are at positions
        start .. start+n_new-1, and `blocks` hold positions 0 .. start+n_new-1. Computed
        per sequence on the host (numpy: no Python loop over tokens), in two transfers,
        with no read back."""
        starts = np.array([s for s, _, _ in seqs], dtype=np.int64)
        counts = np.array([n for _, n, _ in seqs], dtype=np.int64)
        lens = starts + counts
        b, offsets = len(seqs), np.concatenate([[0], np.cumsum(counts)])
        width = max(len(blocks) for _, _, blocks in seqs)
        small = np.zeros(b * (width + 1), dtype=np.int32)  # context lengths, then the block table
        small[:b] = lens
        table = small[b:].reshape(b, width)
        for row, (start, n, blocks) in zip(table, seqs):
            if start + n > len(blocks) * block_size:  # (its slots would be those of block 0: another's tokens)
                raise RuntimeError(f"a step's {n} tokens from position {start} reach past the {len(blocks)} blocks"
                                   " its sequence holds (a bookkeeping fault)")
            row[: len(blocks)] = blocks
        seq = np.repeat(np.arange(b), counts)
        positions = np.arange(offsets[-1]) - offsets[seq] + starts[seq]
        slots = table[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
        big = to_device(torch.from_numpy(np.concatenate([positions, slots, offsets, starts])), torch.device(device))
        small = to_device(torch.from_numpy(small), torch.device(device))
        t = len(positions)
        single = counts == 1
        d = b if single.all() else int(single.argmin())
        return cls(big[:t], big[t : 2 * t], big[2 * t : 2 * t + b + 1], int(lens.sum()), small[b:].view(b, width),
                   small[:b], big[2 * t + b + 1 :], block_size, int(counts.max()), int(lens.max()),
                   decode_rows=d, decode_context=int(lens[:d].max()) if d else 0,
                   prompt_lens=tuple(lens[d:].tolist()), prompt_max_q=int(counts[d:].max()) if d < b else 0)
