"""Decode steps as CUDA graphs: the whole forward, the output head and the log-softmax
of a batch of rows, one token each, captured once per bucket of rows and replayed.

An eager decode step launches about a thousand kernels, and on a GPU as fast as an
H200 launching them takes longer than running them. A replay launches them all at once.

What a graph bakes in is addresses, so everything that changes between steps lives in
buffers of fixed address that each step fills before the replay: the tokens, positions,
cache slots and context lengths ([4, max batch] int64) and the block tables ([max batch,
blocks of the longest context] int32). A batch is padded up to its bucket with rows that
read and write only a scratch block of the cache, which the engine never hands out. The
cache itself is found through its pointer table (LatentCache.ptrs), which the graphs own:
a worker captures against its small warm-up cache, and its real cache, allocated when it
takes a slot, writes its addresses into the same table. No context length is baked in
either: the attention kernel sizes each sequence's splits on the device (mla_decode.py).

A row is one token attending to its sequence's cache up to and including its own
position, so a speculative verify step is a decode step too: a sequence's pending token
and its k drafts are k + 1 rows at consecutive positions with the same block table, each
written to the cache before any row attends (the causal mask, row by row). A sequence
that does not draft is one row beside them. The graphs also keep the rows' hidden states,
which the drafter reads; with `mtp` they replay the MTP layer's step instead (its input:
the hidden states to chain on, one more buffer), against the target's cache and address
table.

Sampling stays outside: it is per request (generators, top-p, penalties) and small.
A step launched ahead of its tokens reaching the host (pipeline.py) takes them from
the device: the last step's draws, copied into the tokens buffer after the fill.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from preload.checkpoint.config import ModelConfig
from preload.worker.model.deepseek import Transformer
from preload.worker.model.kv_cache import AttentionMeta, LatentCache

log = logging.getLogger(__name__)
T = TypeVar("T")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: BUCKETS up to max_batch, and max_batch itself, never more
    than the last bucket. A larger batch runs eagerly: launches cost little beside its
    work, while a graph for it would hold its activations for good (--max-num-seqs 100000
    captured a 100,000-row step: 3 GiB of device memory per worker outside every budget)."""
    max_batch = min(max_batch, BUCKETS[-1])
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


def captured(run: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` once eagerly (that compiles its kernels and makes what the model makes lazily),
    then captured as a graph whose memory shares `pool` (None: a new pool): (the graph, what
    the captured run returned). Both on this process's one capture stream (capture_stream)."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection while capturing: a collection that frees a dead graph (an engine's
    # of before, a dropped bucket's, kept by a reference cycle) destroys it, a call the driver
    # forbids while this thread captures, and the capture fails (H100: a test module's sixth
    # engine failed to capture its batch-16 graph). The garbage waits for the next collection.
    collecting = gc.isenabled()
    gc.disable()
    try:
        # thread_local: a capture between steps must not fail over another thread's CUDA call
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            out = run()
    finally:
        if collecting:
            gc.enable()
    return graph, out


def capture_stream() -> torch.cuda.Stream:
    """The one side stream on which this process warms up and captures every graph of the
    current device. cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run
    on, for the life of the process: warm-ups on streams of their own (torch hands out up
    to 32) held 30 of them, ~1 GiB of a V2-Lite worker on an H100, graphs or no graphs."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


class DecodeGraphs:
    """The captured decode steps of one model for one cache layout (block size, cache
    dtype): capture() once, with an engine's cache bound to `cache_ptrs`; then
    replay() for any batch of decode and verify spans that fits. `cache_layers`: the
    cache's layers (the MTP layer's one more); `cache_ptrs`: another DecodeGraphs'
    table, for graphs over the same cache (the MTP layer's, `mtp`)."""

    def __init__(self, model: Transformer, max_rows: int, block_size: int, kv_cache_dtype: str, device: torch.device,
                 *, cache_layers: int | None = None, cache_ptrs: torch.Tensor | None = None, mtp: bool = False,
                 fills: int = 1, shifted: bool = False):
        cfg: ModelConfig = model.cfg
        self.model, self.block_size, self.kv_cache_dtype, self.mtp = model, block_size, kv_cache_dtype, mtp
        self.sizes = bucket_sizes(max_rows)
        self.width = -(-cfg.max_position_embeddings // block_size)  # blocks of the longest context
        self.cache_ptrs = cache_ptrs if cache_ptrs is not None else \
            torch.zeros(cache_layers or cfg.num_layers, 4, dtype=torch.long, device=device)
        n = self.sizes[-1]
        # (mtp: the hidden states each row chains on)
        self.hidden_in = torch.zeros(n, cfg.hidden_size, dtype=model.embed.dtype, device=device) if mtp else None
        self.ids = torch.zeros(4, n, dtype=torch.long, device=device)  # tokens, positions, slots, context lengths
        self.table = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        # (`shifted`: how far each row lies past the position filled in, known on the device
        # only, applied by the graph itself: shift_rows)
        self.shift = torch.zeros(n, dtype=torch.long, device=device) if shifted else None
        # The host side of the same, copied in at most two transfers a replay. Taken in turn
        # from a ring: a step launched ahead (pipeline.py) fills its buffers while the copies
        # out of the step in flight's may still wait in the stream (an event says when they
        # are done), and a drafter fills its graphs `fills` times a step (the catch-up, then
        # each chained draft). A fill that finds the next buffer still queued takes a new
        # one, up to two steps' worth, rather than wait: waiting there would make the host
        # wait for the GPU to finish the step in flight, and the overlap is gone.
        self.host: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self.turns, self._turn = 2 * fills, 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (log-probs, hidden states) per bucket
        # Every bucket's log-probs in one buffer (each bucket's own held 16 of them at
        # once, 0.5 GiB of float32 rows over V2-Lite's vocabulary, live for good).
        self.logprobs = torch.empty(n, model.head.shape[0], dtype=torch.float32, device=device)
        self.pool = None  # the captures' shared memory pool: the first (largest) capture sizes it

    def fits(self, batch: list[tuple]) -> bool:
        """Whether a step of (sequence, start, n) spans can be replayed: one new token each,
        or a pending token and its drafts (a verify span), and `holds` them."""
        return (all(n == 1 or n == 1 + len(seq.drafts) for seq, _, n in batch)
                and self.holds(fed_rows(batch), [seq.blocks for seq, _, _ in batch]))

    def holds(self, rows: int, tables: list[list[int]]) -> bool:
        """Whether `rows` rows with these block tables fit a captured bucket, every context
        within the table."""
        return bool(self.graphs) and rows <= max(self.graphs) and all(len(t) <= self.width for t in tables)

    def bucket(self, n: int) -> int:
        """The bucket `n` rows are replayed in, once it is captured."""
        return next(s for s in self.sizes if s >= n)

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet, smallest first."""
        return [s for s in self.sizes if s not in self.graphs]

    def _meta(self, size: int) -> AttentionMeta:
        tokens, positions, slots, lens = self.ids[:, :size]
        longest = self.width * self.block_size
        return AttentionMeta(positions, slots, q_starts=None, context_tokens=0, block_table=self.table[:size],
                             context_lens=lens, starts=positions, block_size=self.block_size, max_q=1,
                             max_context=longest, decode_rows=size, decode_context=longest)

    def _step(self, size: int, cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shift is not None:
            self.shift_rows(size)
        tokens, meta = self.ids[0, :size], self._meta(size)
        if self.mtp:
            hidden, logits = self.model.mtp_step(self.hidden_in[:size], tokens, meta, cache)
        else:
            hidden = self.model.forward(tokens, meta, cache)
            logits = self.model.logits(hidden)
        return torch.log_softmax(logits, -1, out=self.logprobs[:size]), hidden

    def _fill(self, rows: list[tuple[int, int, list[int]]], size: int, scratch_block: int) -> None:
        """rows: (token, position, blocks) of each row; the rest of `size` is padding."""
        host_ids, host_table, copied = self._host_buffers()
        ids, table, bs = host_ids.numpy(), host_table.numpy(), self.block_size
        width = 1
        for i, (token, pos, blocks) in enumerate(rows):
            ids[:, i] = (token, pos, blocks[pos // bs] * bs + pos % bs, pos + 1)
            table[i, : len(blocks)] = blocks
            width = max(width, len(blocks))
        ids[:, len(rows) : size] = ((0,), (0,), (scratch_block * bs,), (1,))
        table[len(rows) : size, 0] = scratch_block
        self.ids[:, :size].copy_(host_ids[:, :size], non_blocking=True)
        self.table[:size, :width].copy_(host_table[:size, :width], non_blocking=True)
        copied.record()

    def _host_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """The next host buffers in turn whose last copy out is done: a new one while each is
        still queued and the ring has room, else the oldest once its copy is done."""
        turn = self._turn
        if not self.host or (not self.host[turn][2].query() and len(self.host) < self.turns):
            n = self.ids.shape[1]
            self.host.insert(turn, (torch.zeros(4, n, dtype=torch.long).pin_memory(),
                                    torch.zeros(n, self.width, dtype=torch.int32).pin_memory(), torch.cuda.Event()))
        self._turn = (turn + 1) % len(self.host)
        buffers = self.host[turn]
        if not buffers[2].query():  # (a full ring: wait for the oldest's copy)
            buffers[2].synchronize()
        return buffers

    def ensure(self, cache: LatentCache, scratch_block: int, sizes: list[int]) -> bool:
        """Capture those of `sizes` not captured yet (a ~0.1 s stall each on the H200);
        whether any was. A failure (no memory for it, say) is logged and ends the
        captures: the rows those buckets would take replay a larger one, padded."""
        todo = [s for s in sizes if s in self.pending]
        if not todo:
            return False
        try:
            self.capture(cache, scratch_block, todo)
            return True
        except RuntimeError as e:
            log.warning("decode graphs not captured (%s); rows of %s replay a larger one", e, self.pending)
            self.sizes = sorted(self.graphs)
            return False

    @torch.inference_mode()
    def capture(self, cache: LatentCache, scratch_block: int, sizes: list[int] | None = None) -> None:
        """Capture `sizes` (default: every bucket still pending), largest first: the first
        capture, of the largest bucket, sizes the memory pool the others then fit in. A
        worker on a cold start's path captures only the largest before it is ready (every
        decode batch fits it, padded) and each other bucket at its first use or while the
        engine is idle (Engine.capture_idle): 16 captures, 2.5-3.3 s of a V2-Lite worker's
        start on the H200, leave its start.
        `cache` must have been made with ptrs=self.cache_ptrs."""
        assert cache.ptrs is self.cache_ptrs, "the cache must write its addresses into the graphs' table"
        t0, held = time.monotonic(), torch.cuda.memory_reserved()
        todo = sorted(self.pending if sizes is None else set(sizes) - set(self.graphs), reverse=True)
        if todo and self.pool is None and todo[0] != self.sizes[-1]:
            todo.insert(0, self.sizes[-1])  # (the pool is sized by the largest)
        for size in todo:
            self._capture(size, cache, scratch_block)
        torch.cuda.synchronize()
        if todo:  # (with what the pool took: the KV cache budget's reserve must cover it, kv_cache.worker_reserve)
            log.info("captured %d decode graphs (batch %s) in %.2f s, %+.1f MiB reserved", len(todo),
                     ",".join(map(str, sorted(todo))), time.monotonic() - t0, (torch.cuda.memory_reserved() - held) / (1 << 20))

    def _capture(self, size: int, cache: LatentCache, scratch_block: int) -> None:
        self._fill([], size, scratch_block)
        graph, self.outputs[size] = captured(lambda: self._step(size, cache), self.pool)
        self.pool = graph.pool()
        self.graphs[size] = graph

    def replay(self, batch: list[tuple], scratch_block: int, tokens: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [rows, vocab] of the token after each row, hidden states [rows, D])
        for (sequence, start, n) spans that fit, a row per token fed in order; valid until
        the next replay (the graphs share their memory). `tokens`: the batch's input
        tokens on the device, when the host does not have them yet; `shift`: replay_rows'."""
        fed = [(t, start + j, seq.blocks) for seq, start, n in batch
               for j, t in enumerate([0] * n if tokens is not None else seq.tokens(start, start + n))]
        return self.replay_rows(fed, scratch_block, tokens, shift=shift)

    def replay_rows(self, rows: list[tuple[int, int, list[int]]], scratch_block: int, tokens: torch.Tensor | None = None,
                    hidden: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As replay, for rows of (token, position, blocks); `tokens` and (mtp) `hidden`:
        the rows' inputs on the device, in place of the host's tokens; `shift`: how far each
        row's position lies past the host's, known on the device only (shift_rows)."""
        size = min(s for s in self.graphs if s >= len(rows))
        self._fill(rows, size, scratch_block)
        if tokens is not None:
            self.ids[0, : len(rows)].copy_(tokens)
        if hidden is not None:
            self.hidden_in[: len(rows)].copy_(hidden)
        if shift is not None:
            self.shift[: len(shift)].copy_(shift)
        self.graphs[size].replay()
        logprobs, states = self.outputs[size]
        return logprobs[: len(rows)], states[: len(rows)]

    def shift_rows(self, size: int) -> None:
        """Move each of the first `size` rows on by its `shift`, within the graph, and zero
        the shifts for the next replay: a step launched before the one in flight has landed
        knows its rows' positions up to the drafts that step keeps (drafts_ahead.py), which
        the replay copies into `shift`. Their context lengths follow, and their cache slots
        are read again from the block tables, which reach that far."""
        bs, shift = self.block_size, self.shift[:size]
        positions = self.ids[1, :size] + shift
        blocks = self.table[:size].gather(1, (positions // bs)[:, None])[:, 0].long()
        self.ids[1:, :size] = torch.stack([positions, blocks * bs + positions % bs, positions + 1])
        shift.zero_()


def fed_rows(batch: list[tuple]) -> int:
    """The rows (tokens fed) of a batch of (sequence, start, n) spans."""
    return sum(n for _, _, n in batch)
