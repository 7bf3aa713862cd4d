"""Which blocks of a slot's KV memory hold which prefix, written where the memory is, so
that the slot's next core can take them up (issue 33: a dead core's requests resumed on
its replacement compute again only what the cache lost).

A slot's KV memory outlives its cores (ipc/kv_memory.py). Its last rows are this
ledger: a header naming the cache's layout, then for each block the prefix-cache key
(block_manager.block_key) of what it holds, or zeros. A new core with the same layout
reads it and counts those blocks as cached (evictable: nobody holds them), so that a
request handed over with its output so far finds its full blocks in the prefix cache.

Why an entry can be trusted: a block's key is written after the step that filled it and
erased before anything is written to it again, in the order the device runs the work
(one stream on a GPU; program order on a CPU). So however a core dies, a key that made
it into the memory names a block whose content made it too, and a block that was being
written has no key. Updates are gathered and written in one copy before each forward.
"""

from __future__ import annotations

import hashlib

import torch

from preload.worker.model.host_values import to_device

KEY_BYTES = 32  # a block key: SHA-256


def layout_key(*fields) -> bytes:
    """The header: what a cache's layout is (block size, blocks, the model's and the
    cache's shapes and dtypes); a ledger under another header is not read."""
    return hashlib.sha256(repr(fields).encode()).digest()


def ledger_bytes(num_blocks: int) -> int:
    return (num_blocks + 1) * KEY_BYTES


class BlockLedger:
    def __init__(self, table: torch.Tensor, layout: bytes):
        """`table`: [num_blocks + 1, KEY_BYTES] uint8 in the slot's KV memory (row 0 the header)."""
        self.table, self.layout = table, layout
        self.pending: dict[int, bytes] = {}  # block -> its key (or zeros) to write at the next flush

    def read(self) -> dict[int, bytes]:
        """The blocks the last core left keyed (none if it had another layout, or none
        was here: then the ledger is started anew under our header)."""
        rows = self.table.cpu().numpy()
        if rows[0].tobytes() != self.layout:
            self.reset()
            return {}
        keyed = rows[1:].any(axis=1).nonzero()[0]  # (a whole cache's ledger, 180k rows on an H200, in one pass)
        return {int(block): rows[1 + block].tobytes() for block in keyed}

    def reset(self) -> None:
        """No block keyed, under our header: for a core that keeps no ledger (no prefix
        caching, or drafts, whose own cache it would not vouch for), whose writes would
        otherwise land in blocks a later core took for cached."""
        self.pending = {}
        self.table.zero_()
        self.table[0] = torch.frombuffer(bytearray(self.layout), dtype=torch.uint8).to(self.table.device)

    def keyed(self, block: int, key: bytes) -> None:
        self.pending[block] = key

    def erased(self, block: int) -> None:
        self.pending[block] = bytes(KEY_BYTES)

    def flush(self) -> None:
        """Write what changed since the last flush, in the device's order: before the
        forward that may write the erased blocks, after the steps that filled the keyed."""
        if not self.pending:
            return
        blocks = torch.tensor(list(self.pending), dtype=torch.long) + 1
        rows = torch.frombuffer(bytearray(b"".join(self.pending.values())), dtype=torch.uint8).view(-1, KEY_BYTES)
        self.pending = {}
        dev = self.table.device
        self.table.index_copy_(0, to_device(blocks, dev), to_device(rows, dev))
