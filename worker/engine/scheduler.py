"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget. Running sequences go first, oldest first (one token
each when decoding, a chunk when still prefilling); then waiting ones are admitted
while the budget, `max_num_seqs` and free cache blocks allow. When blocks run out,
the newest running sequence is preempted: its blocks are freed and it waits at the
head of the queue, to be recomputed (output kept) when room returns.
"""

from __future__ import annotations

import time
from collections import deque

from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.computed, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget, batch = self.max_num_batched_tokens, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.pending, budget)
            while not self.blocks.can_grow(seq, seq.computed + n) and seq.status is Status.RUNNING:
                self._preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, seq.computed + n)
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.pending, budget)
            if not self.blocks.can_grow(seq, seq.computed + n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            self.blocks.grow(seq, seq.computed + n)
            batch.append((seq, n))
            budget -= n
        return batch
