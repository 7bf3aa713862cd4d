"""The ledger of a slot's KV memory (worker/engine/block_ledger.py): the blocks one block
manager keyed are those the next one on the same memory takes up as cached; a block taken
back for other content loses its key before anything is written to it; a ledger of
another layout, or reset by a core that keeps none, names no block."""

from __future__ import annotations

import torch

from preload.worker.engine.block_ledger import KEY_BYTES, BlockLedger, layout_key
from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence

BLOCKS, SIZE = 6, 4
LAYOUT = layout_key(BLOCKS, SIZE, "test")


def table() -> torch.Tensor:
    return torch.zeros(BLOCKS + 1, KEY_BYTES, dtype=torch.uint8)  # (the KV memory's tail, zeroed as fresh memory is)


def manager(memory: torch.Tensor, layout: bytes = LAYOUT) -> tuple[BlockManager, int]:
    blocks = BlockManager(BLOCKS, SIZE, prefix_caching=True)
    return blocks, blocks.keep_ledger(BlockLedger(memory, layout))


def computed(blocks: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all computed (its full blocks keyed), then released."""
    seq = Sequence(tokens, SamplingParams(max_tokens=1))
    blocks.grow(seq, len(tokens))
    seq.computed = len(tokens)
    blocks.cache_full_blocks(seq)
    blocks.release(seq)
    blocks.ledger.flush()
    return seq


def test_the_next_manager_takes_up_the_blocks_the_last_one_keyed():
    memory = table()
    first, taken = manager(memory)
    assert taken == 0
    computed(first, list(range(10)))  # two full blocks (and half of a third)
    second, taken = manager(memory)
    assert taken == 2 and second.used == 0  # cached, nobody holding them
    again = Sequence(list(range(10)) + [99], SamplingParams(max_tokens=1))
    assert second.match_prefix(again) == 8 and again.blocks == list(first.key_of)


def test_a_block_taken_for_other_content_loses_its_key_first():
    memory = table()
    first, _ = manager(memory)
    computed(first, list(range(8)))  # blocks 0 and 1 keyed
    hog = Sequence(list(range(100, 124)), SamplingParams(max_tokens=1))
    first.grow(hog, 24)  # all six blocks: the free four, then the two cached ones, evicted
    first.ledger.flush()
    assert manager(memory)[1] == 0


def test_another_layout_or_a_reset_names_no_block():
    memory = table()
    first, _ = manager(memory)
    computed(first, list(range(8)))
    assert manager(memory, layout_key(BLOCKS, SIZE, "other"))[1] == 0  # (and it started the ledger anew)
    assert manager(memory)[1] == 0
    computed(manager(memory)[0], list(range(8)))
    BlockLedger(memory, LAYOUT).reset()
    assert manager(memory)[1] == 0
