"""The model's prefill on a GPU (kernels/mla_prefill.py, flash-style over the paged cache)
reads a step's layout as AttentionMeta.build makes it: for a mixed step (a whole prompt,
a continued prompt, a decode row) the kernel fed from the meta gives what the CPU's
gather-and-mask path gives from the same meta. Triton's interpreter runs it here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from preload.checkpoint.config import ModelConfig  # noqa: E402
from preload.kernels.attention import mla_expanded  # noqa: E402
from preload.kernels.mla_prefill import mla_prefill  # noqa: E402
from preload.options import BUNDLED_MODEL  # noqa: E402
from preload.worker.model.kv_cache import AttentionMeta, LatentCache  # noqa: E402

HEADS, DN, DR, DV, RANK, PAGE = 4, 32, 16, 32, 64, 16


def test_the_kernel_reads_the_steps_layout_as_the_gather_path_does():
    gen = torch.Generator().manual_seed(0)
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)  # kv_lora_rank 64, qk_rope_head_dim 16
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (RANK, DR)
    cache = LatentCache(1, 16 * PAGE, cfg, torch.bfloat16, "cpu")
    cache.c_kv[0].copy_(torch.randn(16 * PAGE, RANK, generator=gen))
    cache.k_pe[0].copy_(torch.randn(16 * PAGE, DR, generator=gen))
    # (start, new tokens, blocks): a whole prompt, a prompt's second chunk, a decode row.
    spans = [(0, 20, [3, 9]), (37, 5, [1, 4, 12]), (50, 1, [15, 0, 7, 2])]
    meta = AttentionMeta.build(spans, PAGE, "cpu")
    rows = sum(n for _, n, _ in spans)
    q_nope = torch.randn(rows, HEADS, DN, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(rows, HEADS, DR, generator=gen).to(torch.bfloat16)
    kv_b = (torch.randn(HEADS * (DN + DV), RANK, generator=gen) * 0.1).to(torch.bfloat16)

    got = mla_prefill(q_nope, q_pe, kv_b, cache.pools(0), meta.block_table, meta.context_lens, meta.q_starts, PAGE,
                      meta.max_context, meta.max_q, 0.1, chunk=32, context_tokens=meta.context_tokens)
    c_kv, k_pe = cache.read(0, meta.kv_slots)
    want = mla_expanded(q_nope.float()[meta.q_index], q_pe.float()[meta.q_index], c_kv.float(), k_pe.float(),
                        kv_b.float(), meta.mask, 0.1)[meta.q_valid]
    assert meta.context_tokens == 20 + 42 + 51
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()
