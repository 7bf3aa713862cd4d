"""Fixed-size blocks of cache slots, handed to sequences as they grow."""

from __future__ import annotations

from collections import deque

from preload.worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """More blocks `seq` needs to hold its first `tokens` tokens."""
        return max(0, -(-tokens // self.block_size) - len(seq.blocks))

    def can_grow(self, seq: Sequence, tokens: int) -> bool:
        return self.blocks_needed(seq, tokens) <= len(self.free)

    def grow(self, seq: Sequence, tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, tokens)):
            seq.blocks.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.blocks)
        seq.blocks = []
