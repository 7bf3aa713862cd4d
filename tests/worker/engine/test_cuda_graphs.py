"""The decode batch sizes captured as CUDA graphs (the capture itself: tests/gpu/test_graphs.py):
every size up to --max-num-seqs has a bucket at most a little larger, and no graph is
captured past the last bucket, whatever --max-num-seqs says (a graph keeps its
activations on the device for good; a larger batch runs eagerly)."""

from __future__ import annotations

import pytest

from preload.worker.engine.cuda_graphs import BUCKETS, bucket_sizes


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64, 100, 256, 300, 512, 513, 100_000])
def test_buckets_cover_every_batch_up_to_the_cap(max_num_seqs):
    sizes = bucket_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_num_seqs, BUCKETS[-1])
    for batch in range(1, sizes[-1] + 1):
        padded = min(s for s in sizes if s >= batch)
        assert padded <= max(2 * batch, batch + 64)  # padding never more than doubles a step or adds 64 rows
