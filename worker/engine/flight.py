"""A step launched and booked, not yet landed (`Flight`), and what every step launched ahead
does the same way, with drafts or without (pipeline.py, drafts_ahead.py): the order of its
spans, its draws on the device, and who draws their last token in it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from preload.worker.engine.faults import SequenceFault, stage
from preload.worker.engine.sampler import sample_batch, steer
from preload.worker.engine.sequence import Sequence
from preload.worker.engine.step_clock import StepClock
from preload.worker.model.host_values import on_device

if TYPE_CHECKING:  # (the engine makes its pipeline)
    from preload.worker.engine.engine import Engine

PLACEHOLDER = -1  # an output token drawn on the device, not yet landed (never fed: _inputs)


@dataclass
class Flight:
    """A step launched and booked, not yet landed: `spans` (sequence, start, n) computed;
    `seqs` draw a token each, at output index `marks[i]`, drawn into `tokens` on the device
    (the next step's inputs) and on their way to the host (`host`, complete when `copied`
    is)."""

    spans: list[tuple[Sequence, int, int]]
    seqs: list[Sequence] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    n_top: int = 0
    copied: torch.cuda.Event | None = None  # None: on a CPU, where the copy is done when made
    faults: dict[Sequence, SequenceFault] = field(default_factory=dict)  # whose draw failed: they end at landing
    logprobs: torch.Tensor | None = None  # the rows its draws read, kept until they are made late (_draw)
    # A drafted step (drafts_ahead.py): the drafts each of `seqs` had verified, and how many
    # of them it keeps, on the device (the next step's rows lie that far past the host's).
    ks: list[int] = field(default_factory=list)
    kept: torch.Tensor | None = None

    @cached_property
    def rows(self) -> dict[int, int]:
        """Each of `seqs`' index among them, by id (a later step looks its sequences up here)."""
        return {id(seq): row for row, seq in enumerate(self.seqs)}

    def send(self, packed: torch.Tensor) -> None:
        """Queue what the host needs of the step (`packed`, on the device) to the host, in
        one copy that nothing waits for until the landing (`landed`)."""
        if packed.device.type != "cuda":
            self.host = packed
            return
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.host.copy_(packed, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def landed(self, clock: StepClock) -> list:
        """What `send` queued, on the host, once it is there (the wait is `clock`'s gpu_wait)."""
        if self.copied is not None:
            waited = time.perf_counter()
            self.copied.synchronize()
            clock.gpu_wait += time.perf_counter() - waited
        return self.host.tolist()


def spans_of(batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int]]:
    """A step's (sequence, start, n) spans, sequences of one new token first: attention takes
    them apart, as decode rows (AttentionMeta). Every step's, launched ahead or not."""
    return sorted(((seq, seq.computed, n) for seq, n in batch), key=lambda span: span[2] != 1)


def decoding(batch: list[tuple[Sequence, int]]) -> bool:
    """Whether a scheduled batch is a decode step: each sequence's one pending token, and
    its drafts if it has any (a verify step is a decode step too, for the metrics)."""
    return all(n == 1 + len(seq.drafts) for seq, n in batch)


def drawn_before(seqs: list[Sequence], before: Flight | None) -> torch.Tensor | None:
    """Each of `seqs`' token drawn in `before` and not landed (its output's placeholder), on
    the device, for the penalties (sampler.steer); None where no draw reads its output."""
    if before is None or before.tokens is None or not any(s.params.shapes_logits for s in seqs):
        return None
    picked = [before.rows.get(id(seq), 0) for seq in seqs]  # (row 0 where none: its output ends with no placeholder)
    return before.tokens[on_device(picked, before.tokens.device, torch.long)]


def draw(e: Engine, seqs: list[Sequence], logprobs: torch.Tensor, outputs: list[list[int]],
         pending: torch.Tensor | None) -> tuple[torch.Tensor, dict[Sequence, SequenceFault]]:
    """A token for each of `seqs` from its row of `logprobs` as the operator's processors and
    the requests shape it (`outputs`: each one's tokens before it; `pending`: drawn_before),
    on the device, for the whole batch at once; if that fails, row by row, so that a failure
    is the one sequence's whose row it is (its token then 0, fed to a step launched meanwhile
    for nothing)."""
    generators = [s.generator_at(len(out)) for s, out in zip(seqs, outputs)]  # (the index of the token drawn)

    def drawn(rows: torch.Tensor, seqs: list[Sequence], outputs: list[list[int]], generators: list,
              pending: torch.Tensor | None) -> torch.Tensor:
        params = [s.params for s in seqs]
        steered = steer(e.processed(rows, seqs, outputs), params, [s.prompt for s in seqs], outputs, e.stop_ids,
                        [s.matcher for s in seqs], pending)
        return sample_batch(steered, params, generators, outputs, pending)

    try:
        with stage("sampling"):
            return drawn(logprobs, seqs, outputs, generators, pending), {}
    except SequenceFault:
        pass
    tokens, faults = [], {}
    for i, seq in enumerate(seqs):
        try:
            with stage("sampling"):
                tokens.append(drawn(logprobs[i : i + 1], [seq], outputs[i : i + 1], [generators[i]],
                                    pending[i : i + 1] if pending is not None else None))
        except SequenceFault as fault:
            faults[seq] = fault
            tokens.append(torch.zeros(1, dtype=torch.long, device=logprobs.device))
    return torch.cat(tokens), faults


def drawn_last(flight: Flight) -> set[Sequence]:
    """`flight`'s sequences whose booked token is their last by length: none computes again."""
    return {seq for seq, mark in zip(flight.seqs, flight.marks) if mark + 1 >= seq.params.max_tokens}
