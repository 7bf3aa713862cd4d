"""The latent cache's pools, made alone or cut from a slot's KV memory: each starts on a
16-byte boundary, which the GPU kernels that find the pools through the address table are
told (`tl.multiple_of` in kernels/mla_decode.py and cache_write.py), and none overlaps
another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from preload import BUNDLED_MODEL
from preload.checkpoint.config import ModelConfig
from preload.worker.model.kv_cache import AttentionMeta, CacheMemory, LatentCache


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("slots", [16, 37])  # an odd count: pools of sizes no power of two divides
@pytest.mark.parametrize("cut", [True, False], ids=["cut from KV memory", "made alone"])
def test_every_pool_starts_16_byte_aligned_and_none_overlaps(kv_cache_dtype, slots, cut):
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    layers = cfg.num_layers
    memory = None
    if cut:
        n = LatentCache.nbytes(layers, slots, cfg, torch.bfloat16, kv_cache_dtype)
        memory = CacheMemory(SimpleNamespace(tensor=torch.zeros(n, dtype=torch.uint8), size=n))
    cache = LatentCache(layers, slots, cfg, torch.bfloat16, "cpu", kv_cache_dtype, memory=memory)
    pools = [p for kind in (cache.c_kv, cache.k_pe, cache.c_kv_scale, cache.k_pe_scale) for p in kind if p is not None]
    assert len(pools) == layers * (4 if kv_cache_dtype == "fp8" else 2)
    assert all(p.data_ptr() % 16 == 0 for p in pools)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in pools)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_span_past_its_sequences_blocks_is_refused():
    """A step's tokens at positions its sequence holds no block for would take block 0's
    slots (the table's padding): another sequence's tokens, a cached prefix. Refused as
    the bookkeeping fault it is."""
    with pytest.raises(RuntimeError, match="reach past the 2 blocks"):
        AttentionMeta.build([(0, 3, [1]), (6, 3, [2, 3])], 4, "cpu")
    AttentionMeta.build([(0, 3, [1]), (5, 3, [2, 3])], 4, "cpu")  # (positions 5-7: within the two)
