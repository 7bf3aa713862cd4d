"""Decode steps launched one ahead (--async-scheduling): the next step goes to the GPU
before this step's tokens reach the host.

Between two decode steps the host waits for the tokens, detokenizes, checks stop
conditions, schedules, fills the next step's inputs and launches it: on an H200 at
batch 1 that is about 0.4 ms against the GPU's 2.6, and the GPU idles through it. But
when every running sequence is decoding and nobody waits to be admitted, the next
step's batch is known before its tokens are: the same sequences, one position on. So
the engine launches step k+1 with step k's draws still on the device (copied into its
inputs there), and only then waits for step k's tokens and does the host's work, while
the GPU computes k+1. Sampling runs on the device as part of the launch; what the host
needs of it comes back in one copy that the next launch does not wait for.

What it costs: a sequence that step k finishes (a stop token, a stop string, an abort)
was computed once more in k+1 for nothing; that step's cache write lands in blocks the
sequence has released, before (in the stream's order) anyone else can be given them.
A sequence whose step-k token is its last by length is known ahead: step k+1 is
launched without it, the others' draws picked on the device (a batch whose requests end
at different lengths would otherwise run a step one at a time at every end). What it
needs, else steps run one at a time as without it: sampling that does not read the
host's copy of the output (penalties, logit steering, grammars and logits processors
do), no drafting, no prompt being scored, the same sequences still running and nobody
waiting, and cache blocks for the next position. On a CPU nothing runs asynchronously,
so the engine does not use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from preload.worker.engine.faults import SequenceFault, stage
from preload.worker.engine.host_logprobs import pack, unpack
from preload.worker.model.host_values import on_device
from preload.worker.engine.output import Output
from preload.worker.engine.sampler import sample_batch
from preload.worker.engine.sequence import Sequence

if TYPE_CHECKING:  # (the engine makes its pipeline)
    from preload.worker.engine.engine import Engine


@dataclass
class Flight:
    """A decode step launched and not yet landed: one token for each of `seqs` from
    position `starts[i]`; its draws on the device (`tokens`, the next step's inputs) and
    on their way to the host (`host`, complete when `copied` is). If drawing failed at
    launch, `logprobs` instead: landing draws row by row, as Engine.run does."""

    seqs: list[Sequence]
    starts: list[int]
    tokens: torch.Tensor | None
    host: torch.Tensor | None = None
    n_top: int = 0
    copied: torch.cuda.Event | None = None  # None: on a CPU, where the copy is done when made
    logprobs: torch.Tensor | None = None


class DecodePipeline:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.flight: Flight | None = None

    def takes_step(self) -> bool:
        """Whether the engine's next step is this pipeline's: one is in flight, or the
        running batch is one it can launch."""
        return self.flight is not None or self._steady(self.engine.scheduler.running)

    def step(self) -> list[Output]:
        """Land the step in flight (or launch one, and land that), launching the next
        before the landing whenever it may."""
        flight, self.flight = self.flight, None
        self.engine.clock.kind = "decode_ahead"
        if flight is None:
            batch = self.engine.scheduler.schedule()
            if any(n != 1 for _, n in batch) or len(batch) != len(self.engine.scheduler.running):
                return self.engine.run(batch)  # (not the whole running batch: the step's budget, or a preemption)
            self.engine.clock.kind = "decode"
            flight = self._launch([seq for seq, _ in batch], [seq.computed for seq, _ in batch])
        keep = self._continuing(flight)
        if keep:
            seqs, starts = [flight.seqs[i] for i in keep], [flight.starts[i] + 1 for i in keep]
            for seq, start in zip(seqs, starts):
                self.engine.blocks.grow(seq, start + 1)
            tokens = flight.tokens
            if len(keep) < len(flight.seqs):
                tokens = tokens.index_select(0, on_device(keep, tokens.device))
            self.flight = self._launch(seqs, starts, tokens)
        return self._land(flight)

    def _steady(self, seqs: list[Sequence]) -> bool:
        """Whether `seqs`, the running batch, can be launched ahead: each decoding a token,
        drawn from the device's log-probs alone."""
        e = self.engine
        if not seqs or e.scheduler.waiting or e.drafter is not None or e.processors:
            return False
        if len(seqs) > e.scheduler.max_num_active_seqs:
            return False
        return all(seq.pending == 1 and not seq.drafts and not seq.wants_prompt_logprobs and not seq.params.shapes_logits
                   for seq in seqs)

    def _continuing(self, flight: Flight) -> list[int]:
        """Which of `flight`'s sequences the step after it carries, if it may be launched
        now (else none): its draws are on the device, the same batch runs on (none
        finished or aborted), and there are blocks for the next position. Those whose
        token in `flight` is their last by length are left out."""
        e = self.engine
        if flight.tokens is None or len(e.scheduler.running) != len(flight.seqs) or any(s.finished for s in flight.seqs):
            return []
        if not self._steady(e.scheduler.running):
            return []
        keep = [i for i, seq in enumerate(flight.seqs) if len(seq.output) + 1 < seq.params.max_tokens]
        blocks = sum(e.blocks.blocks_needed(flight.seqs[i], flight.starts[i] + 2) for i in keep)
        return keep if blocks <= e.blocks.num_blocks - e.blocks.used else []  # (free, or cached and evictable)

    def _launch(self, seqs: list[Sequence], starts: list[int], tokens: torch.Tensor | None = None) -> Flight:
        """Compute one token of each of `seqs` from `starts` (inputs: `tokens` on the device,
        else the host's) and draw the next on the device; its copy to the host queued."""
        e = self.engine
        logprobs, _ = e.forward([(seq, start, 1) for seq, start in zip(seqs, starts)], list(range(len(seqs))), tokens)
        try:
            with stage("sampling"):
                # (the token drawn here follows the one at `start`: its output index is one on)
                generators = [s.generator_at(start + 1 - len(s.prompt)) for s, start in zip(seqs, starts)]
                drawn = sample_batch(logprobs, [s.params for s in seqs], generators,
                                     [s.output for s in seqs])
                packed, n_top = pack(seqs, logprobs, drawn)
        except SequenceFault:  # whose? landing tells, row by row
            return Flight(seqs, starts, None, logprobs=logprobs)
        if packed.device.type != "cuda":
            return Flight(seqs, starts, drawn, packed, n_top)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return Flight(seqs, starts, drawn, host, n_top, copied)

    def _land(self, flight: Flight) -> list[Output]:
        """Take `flight`'s draws on the host; advance the sequences still running (the
        others, finished while it ran, were computed for nothing)."""
        e = self.engine
        live = [(i, seq) for i, seq in enumerate(flight.seqs) if not seq.finished]
        for _, seq in live:
            seq.computed += 1
            e.blocks.cache_full_blocks(seq)
        if flight.logprobs is not None:
            drawn = e.sample([(seq, i) for i, seq in live], flight.logprobs)
        else:
            if flight.copied is not None:
                waited = time.perf_counter()
                flight.copied.synchronize()
                e.clock.gpu_wait += time.perf_counter() - waited
            rows = flight.host.tolist()
            drawn = unpack([seq for _, seq in live], [rows[i] for i, _ in live], flight.n_top)
        return e.advance([seq for _, seq in live], drawn)
