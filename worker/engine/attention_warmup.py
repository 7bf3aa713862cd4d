"""The eager attention's kernel variants, launched once while the engine is idle.

A step that carries prompt tokens replays its other pieces from CUDA graphs
(prompt_graphs.py) but runs its attention eagerly, since its layout changes every step.
The kernels it launches compile a variant per tile choice: the decode rows' kernel
(kernels/mla_decode.py) one per number of splits and rows' step (up to 16), the prompts'
one (kernels/mla_prefill.py) another for a context longer than a chunk. On an empty kernel
cache each was compiled when serving first met it, mid-step, stalling every stream in the
step: an H100's first run of workload B (`preload bench serve --requests 100 --concurrency
100 --prompt-len 1000 --output-len 1000`) took 204 ms a prompt step, 36 once they were
compiled: of the 54 kernels first met from the start's return to that run's end (idle
captures among them), 22 were variants of the decode rows' kernels
(results/kernels/compiled-while-serving-v2lite-h100.txt). Launched here one shape at a
time, between steps, each over the scratch block only (its outputs thrown away), they
are compiled, or loaded from the kernel cache, before traffic meets them, and listed for
the next start (kernels/ahead.py).
"""

from __future__ import annotations

import torch

from preload.kernels.prefill import CHUNK
from preload.worker.model.deepseek import Transformer
from preload.worker.model.kv_cache import AttentionMeta, LatentCache

PROMPT_TOKENS = 16  # the prompt a warm-up step carries beside its decode rows

# What this process launched already, by layout (a kernel compiled stays compiled): a later
# engine of the same layout (a spare's, on its slot's cache) has nothing left to launch.
_launched: set[tuple] = set()


class AttentionWarmup:
    """The shapes of eager steps this process has not launched yet (`pending`); `run_one`
    launches the next."""

    def __init__(self, model: Transformer, cache: LatentCache, block_size: int, scratch_block: int, max_rows: int,
                 device: torch.device):
        from preload.kernels.mla_decode import launch_shapes  # Triton: imported only where there is a GPU

        self.model, self.cache, self.device = model, cache, device
        self.block_size, self.scratch = block_size, scratch_block
        c = model.cfg
        self.layout = (block_size, cache.dtype, cache.fp8, c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                       c.qk_rope_head_dim, c.v_head_dim)
        self.pending = [s for s in launch_shapes(c.num_heads, max_rows) if (self.layout, s) not in _launched]

    @torch.inference_mode()
    def run_one(self) -> None:
        """One step's attention of layer 0: `batch` decode rows over `context` tokens each,
        and a prompt of PROMPT_TOKENS tokens, the first time after a context of more than a
        chunk (both of mla_prefill's variants), then with none."""
        batch, context = self.pending.pop()
        cfg = self.model.cfg
        before = 0 if (self.layout, "long context") in _launched else CHUNK
        spans = [(context - 1, 1, self.blocks(context))] * batch
        spans.append((before, PROMPT_TOKENS, self.blocks(before + PROMPT_TOKENS)))
        meta = AttentionMeta.build(spans, self.block_size, self.device)
        # Laid out as Attention.project leaves them: one tensor, split.
        q = torch.zeros(batch + PROMPT_TOKENS, cfg.num_heads, cfg.qk_head_dim, dtype=self.cache.dtype,
                        device=self.device)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        self.model.layers[0].attn.attend(q_nope, q_pe, meta, self.cache)
        _launched.update({(self.layout, (batch, context)), (self.layout, "long context")})

    def blocks(self, tokens: int) -> list[int]:
        return [self.scratch] * -(-tokens // self.block_size)
