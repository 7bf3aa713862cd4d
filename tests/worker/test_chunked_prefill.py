"""The model's prefill on a GPU (kernels/mla_prefill.py, flash-style over the paged cache)
reads a step's layout as AttentionMeta.build makes it: for a mixed step (a whole prompt,
a continued prompt, a decode row) the kernel fed from the meta gives what the CPU's
gather-and-mask path gives from the same meta, and so does the model's attention on a
GPU (`paged_attention`: the decode rows at the head of the step absorbed, the rest
through the kernel). Triton's interpreter runs it here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from preload.checkpoint.config import ModelConfig  # noqa: E402
from preload.kernels.attention import mla_expanded  # noqa: E402
from preload.kernels.mla_prefill import mla_prefill  # noqa: E402
from preload.options import BUNDLED_MODEL  # noqa: E402
from preload.worker.model.deepseek import paged_attention  # noqa: E402
from preload.worker.model.kv_cache import AttentionMeta, LatentCache  # noqa: E402

HEADS, DN, DR, DV, RANK, PAGE = 4, 32, 16, 32, 64, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (Triton on a GPU takes only its tensors)


def test_the_kernel_reads_the_steps_layout_as_the_gather_path_does():
    gen = torch.Generator().manual_seed(0)
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)  # kv_lora_rank 64, qk_rope_head_dim 16
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (RANK, DR)
    cache = LatentCache(1, 16 * PAGE, cfg, torch.bfloat16, DEVICE)
    cache.c_kv[0].copy_(torch.randn(16 * PAGE, RANK, generator=gen).to(DEVICE))
    cache.k_pe[0].copy_(torch.randn(16 * PAGE, DR, generator=gen).to(DEVICE))
    # (start, new tokens, blocks): a whole prompt, a prompt's second chunk, a decode row.
    spans = [(0, 20, [3, 9]), (37, 5, [1, 4, 12]), (50, 1, [15, 0, 7, 2])]
    meta = AttentionMeta.build(spans, PAGE, DEVICE)
    rows = sum(n for _, n, _ in spans)
    q_nope = torch.randn(rows, HEADS, DN, generator=gen).to(torch.bfloat16).to(DEVICE)
    q_pe = torch.randn(rows, HEADS, DR, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv_b = (torch.randn(HEADS * (DN + DV), RANK, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)

    got = mla_prefill(q_nope, q_pe, kv_b, cache.pools(0), meta.block_table, meta.context_lens, meta.q_starts, PAGE,
                      meta.max_context, meta.max_q, 0.1, chunk=32, context_tokens=meta.context_tokens)
    c_kv, k_pe = cache.read(0, meta.kv_slots)
    want = mla_expanded(q_nope.float()[meta.q_index], q_pe.float()[meta.q_index], c_kv.float(), k_pe.float(),
                        kv_b.float(), meta.mask, 0.1)[meta.q_valid]
    assert meta.context_tokens == 20 + 42 + 51
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()


def step(spans, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)  # kv_lora_rank 64, qk_rope_head_dim 16
    cache = LatentCache(1, 16 * PAGE, cfg, torch.bfloat16, DEVICE)
    cache.c_kv[0].copy_(torch.randn(16 * PAGE, RANK, generator=gen).to(DEVICE))
    cache.k_pe[0].copy_(torch.randn(16 * PAGE, DR, generator=gen).to(DEVICE))
    meta = AttentionMeta.build(spans, PAGE, DEVICE)
    rows = sum(n for _, n, _ in spans)
    q_nope = torch.randn(rows, HEADS, DN, generator=gen).to(torch.bfloat16).to(DEVICE)
    q_pe = torch.randn(rows, HEADS, DR, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv_b = (torch.randn(HEADS * (DN + DV), RANK, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    return cache, meta, q_nope, q_pe, kv_b


def gathered(cache, meta, q_nope, q_pe, kv_b):
    c_kv, k_pe = cache.read(0, meta.kv_slots)
    return mla_expanded(q_nope.float()[meta.q_index], q_pe.float()[meta.q_index], c_kv.float(), k_pe.float(),
                        kv_b.float(), meta.mask, 0.1)[meta.q_valid]


def test_a_mixed_steps_decode_rows_are_attended_apart_and_agree_with_the_gather_path():
    # Two decode rows first (as the engine orders a step), then a whole prompt, a continued
    # prompt, and a one-token span behind them (it joins the prompts' kernel).
    spans = [(30, 1, [5, 8]), (47, 1, [11, 2, 6, 13]), (0, 20, [3, 9]), (37, 5, [1, 4, 12]), (15, 1, [7])]
    cache, meta, q_nope, q_pe, kv_b = step(spans)
    assert (meta.decode_rows, meta.decode_context) == (2, 48)
    p = meta.prompts
    assert (p.max_context, p.max_q, p.context_tokens) == (42, 20, 20 + 42 + 16)
    assert p.q_starts.tolist() == [0, 20, 25, 26] and p.context_lens.tolist() == [20, 42, 16]
    got = paged_attention(q_nope, q_pe, kv_b, cache.pools(0), meta, 0.1)
    want = gathered(cache, meta, q_nope, q_pe, kv_b)
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2), (got.float() - want).abs().max()


def test_the_steps_layout_is_computed_per_token_as_its_spans_say():
    spans = [(30, 1, [5, 8]), (0, 3, [3]), (17, 4, [1, 4])]
    meta = AttentionMeta.build(spans, PAGE, DEVICE)
    assert meta.positions.tolist() == [30, 0, 1, 2, 17, 18, 19, 20]
    assert meta.slots.tolist() == [8 * PAGE + 14, 3 * PAGE, 3 * PAGE + 1, 3 * PAGE + 2, 4 * PAGE + 1, 4 * PAGE + 2,
                                   4 * PAGE + 3, 4 * PAGE + 4]
    assert meta.q_starts.tolist() == [0, 1, 4, 8] and meta.starts.tolist() == [30, 0, 17]
    assert meta.context_lens.tolist() == [31, 3, 21] and meta.context_tokens == 55
    assert meta.block_table.tolist() == [[5, 8], [3, 0], [1, 4]] and meta.block_table.dtype == torch.int32
    assert (meta.max_q, meta.max_context, meta.decode_rows, meta.decode_context) == (4, 31, 1, 31)
    assert meta.q_index.tolist() == [[0, 0, 0, 0], [1, 2, 3, 0], [4, 5, 6, 7]]
    assert meta.q_valid.tolist() == [[True, False, False, False], [True, True, True, False], [True] * 4]
    decode = AttentionMeta.build([(4, 1, [0]), (9, 1, [2])], PAGE, "cpu")
    assert (decode.is_decode, decode.decode_rows, decode.decode_context) == (True, 2, 10)
