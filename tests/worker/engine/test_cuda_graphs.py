"""The decode batch sizes captured as CUDA graphs (the capture itself: tests/gpu/test_graphs.py,
tests/gpu/test_speculative_graphs.py): every size up to --max-num-seqs has a bucket at most
a little larger, and no graph is captured past the last bucket, whatever --max-num-seqs
says (a graph keeps its activations on the device for good; a larger batch runs eagerly).
What lets a verify step replay the decode graphs: k + 1 tokens of a sequence fed as
one-token rows, each attending to the cache up to its own position, give what the span fed
whole gives, through the model and through its MTP layer. A replay's fill never waits for
the GPU while the host buffers of two steps' fills can hold it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.cuda_graphs import BUCKETS, DecodeGraphs, bucket_sizes
from preload.worker.model.kv_cache import AttentionMeta


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64, 100, 256, 300, 512, 513, 100_000])
def test_buckets_cover_every_batch_up_to_the_cap(max_num_seqs):
    sizes = bucket_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_num_seqs, BUCKETS[-1])
    for batch in range(1, sizes[-1] + 1):
        padded = min(s for s in sizes if s >= batch)
        assert padded <= max(2 * batch, batch + 64)  # padding never more than doubles a step or adds 64 rows


def test_a_span_fed_as_one_token_rows_gives_what_it_gives_fed_whole():
    options = EngineOptions(kv_cache_memory=16 << 20, enable_prefix_caching=False)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=replace(options, speculative_config='{"method": "mtp", "num_speculative_tokens": 3}'))
    model, cache, bs = llm.model, llm.engine.cache, llm.engine.blocks.block_size
    prompt, fed = list(range(5, 25)), torch.tensor([31, 32, 33, 34])  # 20 tokens in the cache; a pending token and 3 drafts

    def meta(spans):
        return AttentionMeta.build(spans, bs, "cpu")

    got = []
    for blocks, as_rows in (([0, 1], False), ([2, 3], True)):  # each in blocks of its own
        model.forward(torch.tensor(prompt), meta([(0, len(prompt), blocks)]), cache)
        spans = [(20 + j, 1, blocks) for j in range(4)] if as_rows else [(20, 4, blocks)]
        hidden = model.forward(fed, meta(spans), cache)
        x, mtp_logits = model.mtp_step(hidden, fed.roll(-1), meta(spans), cache)  # (the MTP layer's catch-up)
        got.append((model.logits(hidden).log_softmax(-1), hidden, x, mtp_logits))
    assert meta([(20 + j, 1, [2, 3]) for j in range(4)]).decode_rows == 4  # (rows, as a decode step takes them)
    for whole, rows in zip(*got):
        assert torch.allclose(whole, rows, atol=1e-5, rtol=1e-5), (whole - rows).abs().max()


class QueuedCopy:
    """torch.cuda.Event over a copy that stays queued in the stream until waited for."""

    def __init__(self):
        self.queued, self.waits = False, 0

    def record(self, *_) -> None:
        self.queued = True

    def query(self) -> bool:
        return not self.queued

    def synchronize(self) -> None:
        self.waits += 1
        self.queued = False


def test_a_fill_takes_new_host_buffers_while_the_others_copies_are_queued_then_waits_for_the_oldest(monkeypatch):
    # A drafter launched ahead fills its graphs k times a step while the step in flight's
    # copies still wait in the stream: two steps' worth of buffers, then a wait.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(torch.cuda, "Event", QueuedCopy)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=EngineOptions(kv_cache_memory=16 << 20))
    graphs = DecodeGraphs(llm.model, 4, 16, "auto", torch.device("cpu"), fills=3)
    used, take = [], graphs._host_buffers
    monkeypatch.setattr(graphs, "_host_buffers", lambda: used.append(take()) or used[-1])
    for j in range(8):
        graphs._fill([(5 + j, j, [1])], 1, scratch_block=0)
        assert int(graphs.ids[0, 0]) == 5 + j and int(graphs.ids[1, 0]) == j  # (what the fill wrote, copied in)
    assert len(graphs.host) == 6  # 2 x fills, made as needed
    assert len({id(b) for b in used[:6]}) == 6 and used[6] is used[0] and used[7] is used[1]
    assert [b[2].waits for b in used[:6]] == [1, 1, 0, 0, 0, 0]  # the 7th and 8th waited for the oldest copies
