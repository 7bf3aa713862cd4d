"""Fixed-size blocks of cache slots, handed to sequences as they grow, and shared between
sequences that begin with the same tokens (automatic prefix caching).

A block whose slots are all computed gets a key: a digest over its source, its parent
block's key and its tokens, so that a key names the whole prefix up to the block's end.
The source is the weights' fingerprint, the request's `cache_salt` and its adapter (none
yet), kept as separate fields of the encoding: two sources never share a key, however
their strings would read run together. A sequence admitted with nothing computed takes
every cached block of its prompt's longest cached prefix (keeping at least its last
token to compute, whose logits it needs), and is counted as `computed` up to there.

Blocks are reference-counted. Released to zero, a keyed block stays cached, evictable,
least recently used first; a block without a key goes back to the free list. Only full
blocks are shared, and a sequence writes only slots past what it computed, so a shared
block is never written.

With a ledger (block_ledger.py, in a supervised worker's KV memory) every key given and
taken back is written there too, and a new manager starts with the blocks the ledger
names cached: what the slot's last core computed.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque

from preload.worker.engine.sequence import CacheSource, Sequence


def block_key(source: CacheSource, parent: bytes | None, tokens: list[int]) -> bytes:
    """The key of a full block: a JSON array keeps every field apart (a salt "ab" with an
    adapter "c" is not a salt "a" with an adapter "bc"), SHA-256 over it."""
    fields = [source.fingerprint, source.cache_salt, source.adapter, parent.hex() if parent else None, tokens]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}  # block -> its key, once full and cached
        self.by_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks no sequence holds, oldest first
        self.queried_tokens = 0  # tokens of admitted sequences looked up in the cache, and found there (metrics)
        self.hit_tokens = 0
        self.ledger = None  # block_ledger.BlockLedger: the keys, where the slot's next core reads them

    def keep_ledger(self, ledger) -> int:
        """Write keys to `ledger` from now on, and take up the blocks it names as cached
        (evictable, nobody holding them): those the slot's last core left. How many."""
        self.ledger = ledger
        for block, key in ledger.read().items():
            if block < self.num_blocks and key not in self.by_key and block not in self.key_of:
                self.by_key[key], self.key_of[block] = block, key
                self.evictable[block] = None
            else:  # (a key named twice: the block goes to the free list, and its entry with it)
                ledger.erased(block)
        self.free = deque(b for b in range(self.num_blocks) if b not in self.key_of)
        return len(self.key_of)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - len(self.free) - len(self.evictable)

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """More blocks `seq` needs to hold its first `tokens` tokens."""
        return max(0, -(-tokens // self.block_size) - len(seq.blocks))

    def can_grow(self, seq: Sequence, tokens: int) -> bool:
        return self.blocks_needed(seq, tokens) <= len(self.free) + len(self.evictable)

    def grow(self, seq: Sequence, tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, tokens)):
            seq.blocks.append(self._take())

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # the least recently used cached block no one holds
            block, _ = self.evictable.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
            if self.ledger is not None:  # (erased before anything is written to it again)
                self.ledger.erased(block)
        self.refs[block] = 1
        return block

    def release(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None  # (most recently used: evicted last)
                else:
                    self.free.append(block)
        seq.blocks, seq.block_keys = [], []

    # ---- prefix caching ------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int | None:
        """Give a sequence with nothing computed the cached blocks of its longest cached
        prefix; returns the tokens they hold (now counted as computed), None if it was
        not looked up (prefix caching off, or a prompt to score: every row is needed)."""
        if not self.prefix_caching or seq.computed or seq.blocks or seq.wants_prompt_logprobs:
            return None
        bs, source = self.block_size, seq.cache_source
        full = (len(seq) - 1) // bs  # blocks wholly before the last token, which must be computed
        parent = None
        for i in range(full):
            key = block_key(source, parent, seq.tokens(i * bs, (i + 1) * bs))
            block = self.by_key.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            seq.blocks.append(block)
            seq.block_keys.append(key)
            parent = key
        seq.computed = len(seq.blocks) * bs
        return seq.computed

    def count_lookup(self, seq: Sequence, hit: int) -> None:
        """An admitted sequence's lookup, for the prefix cache's metrics (vLLM's meaning:
        the tokens looked up, and those found)."""
        self.queried_tokens += len(seq)
        self.hit_tokens += hit

    def cache_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Key the blocks `seq` has filled since it was last called, so that later
        sequences may share them (a block cached already under that key stays the one);
        `upto`: those of its first `upto` tokens only (a step launched ahead has booked
        more, whose tokens may not have landed: pipeline.py)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_keys), (seq.computed if upto is None else upto) // bs):
            parent = seq.block_keys[-1] if seq.block_keys else None
            key = block_key(seq.cache_source, parent, seq.tokens(i * bs, (i + 1) * bs))
            seq.block_keys.append(key)
            block = seq.blocks[i]
            if key not in self.by_key and block not in self.key_of:
                self.by_key[key], self.key_of[block] = block, key
                if self.ledger is not None:
                    self.ledger.keyed(block, key)
