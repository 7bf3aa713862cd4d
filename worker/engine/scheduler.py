"""Continuous batching: which sequences run in the next step, and with how many tokens.

Preempted sequences wait at the head of the queue, before new arrivals; admitted ones
(which hold KV blocks, and may be partly prefilled) are scheduled before any waiting one.

Each step has a token budget. Running sequences go first, oldest first (one token
each when decoding, a chunk when still prefilling); then waiting ones are admitted
while the budget, `max_num_seqs` and free cache blocks allow, each first given the cached
blocks of its prompt's longest cached prefix (block_manager.py). When blocks run out,
the newest running sequence is preempted: its blocks are freed and it waits at the
head of the queue, to be recomputed (output kept) when room returns.
"""

from __future__ import annotations

import time
from collections import deque

from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.sequence import Sequence, Status


class Scheduler:
    """`max_num_seqs` bounds the sequences admitted (holding KV blocks); `max_num_active_seqs`
    (default: as many) the sequences computed in one step: once that many are admitted
    they take turns, least recently computed first, and while more may be admitted at most
    half of a step's places go to admissions.
    `long_prefill_token_threshold` (0: off) caps the chunk of a prefill longer than it, at
    the threshold divided among the prefills waiting to be admitted (more waiting, smaller
    chunks), so that the budget a step has left admits the short requests behind it."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_active_seqs: int | None = None, long_prefill_token_threshold: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_active_seqs = min(max_num_active_seqs or max_num_seqs, max_num_seqs)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._steps = 0

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
        seq.keep_drafts(0)
        seq.computed, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)  # first in line again: it had its turn before the new arrivals
        self.preemptions += 1

    def _chunk(self, seq: Sequence, budget: int, long_cap: int | None) -> int:
        if seq.drafts:  # decoding: the pending token and the drafts to verify, as many as the budget allows
            seq.keep_drafts(max(budget - seq.pending, 0))
            return min(seq.pending + len(seq.drafts), budget)
        n = min(seq.pending, budget)
        return min(n, long_cap) if long_cap is not None and seq.pending > self.long_prefill_token_threshold else n

    def _long_cap(self) -> int | None:
        if not self.long_prefill_token_threshold:
            return None
        waiting_prefills = sum(1 for seq in self.waiting if seq.pending > 1)
        return max(self.long_prefill_token_threshold // max(waiting_prefills, 1), self.blocks.block_size)

    def schedule(self, skip: set[Sequence] | frozenset = frozenset()) -> list[tuple[Sequence, int]]:
        """The next step's batch; `skip`: running sequences with nothing to compute (a step
        launched ahead draws their last token: pipeline.py)."""
        budget, batch, long_cap = self.max_num_batched_tokens, [], self._long_cap()
        active, turns = self.max_num_active_seqs, self.max_num_active_seqs
        if len(self.running) >= active:  # turns: who went last goes to the back; half the turns, at most,
            self.running.sort(key=lambda seq: seq.last_step)  # for admissions while there is room to admit
            turns -= min(len(self.waiting), self.max_num_seqs - len(self.running), max(active // 2, 1))
        for seq in list(self.running):
            if budget == 0 or len(batch) == turns:
                break
            if seq.status is not Status.RUNNING or seq in skip:
                continue  # preempted earlier in this loop, or done
            n = self._chunk(seq, budget, long_cap)
            # (a drafted step in flight may keep all its drafts: this step's rows then start past them)
            reach = seq.computed + seq.unsure
            if seq.drafts and not self.blocks.can_grow(seq, reach + n):
                seq.keep_drafts(0)  # no room to verify them: decode one token rather than preempt anyone
                n = self._chunk(seq, budget, long_cap)
            while not self.blocks.can_grow(seq, reach + n) and seq.status is Status.RUNNING:
                self._preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, reach + n)
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(batch) < active:
            seq = self.waiting[0]
            if seq.unsure:  # (preempted while a drafted step flies: how many tokens it has is not known yet)
                break
            hit = self.blocks.match_prefix(seq)  # its prompt's cached blocks, shared, count as computed
            n = self._chunk(seq, budget, long_cap)
            if not self.blocks.can_grow(seq, seq.computed + n):
                if hit is not None:
                    self.blocks.release(seq)  # (looked up again when there is room)
                    seq.computed = 0
                break
            if hit is not None:
                self.blocks.count_lookup(seq, hit)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
                seq.cached_tokens = hit or 0
            self.running.append(seq)
            self.blocks.grow(seq, seq.computed + n)
            batch.append((seq, n))
            budget -= n
        self._steps += 1
        for seq, _ in batch:
            seq.last_step = self._steps
        return batch
