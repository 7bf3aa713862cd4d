"""Steps launched one ahead (--async-scheduling): the next step goes to the GPU before
this step's tokens reach the host, prompt and mixed steps as well as decode steps.

Between two steps the host waits for the tokens, detokenizes, checks stop conditions,
schedules, builds the next step's inputs and launches it: on an H200 about 0.4 ms of a
batch-1 decode step's 2.6, and 3-5 ms of a 2,048-token prompt step's 27, the GPU idle
throughout. But what the next step computes does not depend on the values drawn in this
one, only on how many tokens each sequence has: so the engine books a step as soon as it is
launched (each sequence's `computed` moved on, a placeholder appended to the output of each
that draws a token), schedules the next step on that state, launches it with the drawn
tokens copied into its inputs on the device, and only then waits for this step's tokens
and does the host's work while the GPU computes the next. Sampling runs on the device as
part of the launch; what the host needs of it comes back in one copy that the next launch
does not wait for. Landing a step puts the drawn values in place of its placeholders.

What it costs: a sequence that a step ends (a stop token, an abort) was computed once more
in the step launched after it, for nothing; that step's cache write lands in blocks the
sequence has released, before (in the stream's order) anyone else can be given them. A
sequence whose booked token is its last by length is left out of the next step's schedule.
Draws that read the host's copy of the output (a grammar's matcher, the operator's logits
processors) are made late: the step's forward is launched ahead all the same, and its draws
only once the step before it has landed (the matchers have read its tokens), while the GPU
computes that forward; penalties take the token in flight from the device (sampler.py) and
draw at the launch. What it needs, else steps run one at a time as without it: no prompt
being scored; with a drafter, what drafts_ahead.py says (--drafts-ahead). On a CPU nothing
runs asynchronously, so the engine does not use it (the tests give it one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from preload.worker.engine.drafts_ahead import land_drafted, launch_drafted, launches_drafted
from preload.worker.engine.faults import SequenceFault
from preload.worker.engine.flight import PLACEHOLDER, Flight, decoding, draw, drawn_before, drawn_last, spans_of
from preload.worker.engine.host_logprobs import pack, unpack
from preload.worker.model.host_values import on_device
from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence

if TYPE_CHECKING:  # (the engine makes its pipeline)
    from preload.worker.engine.engine import Engine


def launches_ahead(engine: Engine, batch: list[tuple[Sequence, int]]) -> bool:
    """Whether `batch` may be launched before the step in flight lands: nothing read back
    mid-step (with a drafter: drafts_ahead.py)."""
    if engine.drafter is not None:
        return launches_drafted(engine, batch)
    if not batch:
        return False
    return all(not seq.drafts and not seq.wants_prompt_logprobs for seq, _ in batch)


def draws_late(engine: Engine, seqs: list[Sequence]) -> bool:
    """Whether these draws read the host's copy of the outputs: the step before must land first."""
    return bool(engine.processors) or any(seq.matcher is not None for seq in seqs)


class StepPipeline:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.flight: Flight | None = None
        self.next: list[tuple[Sequence, int]] | None = None  # scheduled after the flight, to run from the host

    def busy(self) -> bool:
        return self.flight is not None or self.next is not None

    def step(self) -> list[Output]:
        """Land the step in flight (or launch one, and land that), launching the next
        before the landing whenever it may."""
        e = self.engine
        flight, self.flight = self.flight, None
        if flight is None:
            batch, self.next = self.next or e.scheduler.schedule(), None
            batch = [(seq, n) for seq, n in batch if not seq.finished]  # (ended by the landing that scheduled it)
            if not launches_ahead(e, batch):
                return e.run(batch)
            e.clock.kind = "decode" if decoding(batch) else "prompt"
            flight = self._launch(batch, None)
        else:
            drafted = flight.kept is not None  # (a drafted step: decode and verify rows alone)
            e.clock.kind = "decode_ahead" if drafted or all(n == 1 for _, _, n in flight.spans) else "prompt"
        batch = e.scheduler.schedule(skip=drawn_last(flight))
        if launches_ahead(e, batch):
            self.flight = self._launch(batch, flight)
        elif batch:
            self.next = batch  # (its inputs are read on the host, once this flight has landed)
        outputs = self._land(flight)
        if self.flight is not None and self.flight.logprobs is not None:
            self._draw(self.flight, late=True)  # (the matchers and the outputs now hold `flight`'s tokens)
        return outputs

    def _launch(self, batch: list[tuple[Sequence, int]], before: Flight | None) -> Flight:
        """Compute `batch` (inputs: the host's tokens, and `before`'s draws on the device where
        they are fed), draw a token for each sequence whose pending tokens are all in, queue
        the draws' copy to the host, and book the step."""
        e = self.engine
        if e.drafter is not None:
            return launch_drafted(e, batch, before)
        spans = spans_of(batch)
        rows, seqs, end = [], [], 0
        for seq, start, n in spans:
            end += n
            if start + n == len(seq):  # (its pending tokens all in: the last row's logits draw the next)
                rows.append(end - 1)
                seqs.append(seq)
        logprobs, _ = e.forward(spans, rows, self._inputs(spans, before))
        flight = Flight(spans, seqs, marks=[len(seq.output) for seq in seqs], logprobs=logprobs if seqs else None)
        if seqs and not (before is not None and draws_late(e, seqs)):
            self._draw(flight, late=False, pending=drawn_before(seqs, before))
        for seq, start, n in spans:
            seq.computed = start + n
        for seq in seqs:
            seq.output.append(PLACEHOLDER)
        return flight

    def _draw(self, flight: Flight, late: bool, pending: torch.Tensor | None = None) -> None:
        """Draw `flight`'s tokens on the device and queue their copy to the host. At the
        launch, each output may end with the placeholder of the step before (its value in
        `pending`); late, that step has landed and each ends with `flight`'s own, which the
        draw leaves out. A sequence the landing ended draws nothing (its row: 0)."""
        e, seqs, logprobs = self.engine, flight.seqs, flight.logprobs
        flight.logprobs = None
        live = [i for i, seq in enumerate(seqs) if not seq.finished] if late else list(range(len(seqs)))
        if late:  # (each live output ends with its own placeholder, at its mark: the draw reads what is before)
            if any(len(seqs[i].output) != flight.marks[i] + 1 or seqs[i].output[-1] != PLACEHOLDER for i in live):
                raise RuntimeError("a late draw's output does not end with its placeholder (a bookkeeping fault)")
            for i in live:
                seqs[i].output.pop()
        try:
            outputs = [seqs[i].output for i in live]
            if len(live) == len(seqs):
                flight.tokens, flight.faults = draw(e, seqs, logprobs, outputs, pending)
            else:
                at = on_device(live, logprobs.device, torch.long)
                tokens, flight.faults = draw(e, [seqs[i] for i in live], logprobs[at], outputs, None)
                flight.tokens = torch.zeros(len(seqs), dtype=torch.long, device=logprobs.device).index_copy_(0, at, tokens)
        finally:
            if late:
                for i in live:
                    seqs[i].output.append(PLACEHOLDER)
        packed, flight.n_top = pack(seqs, logprobs, flight.tokens)
        flight.send(packed)

    def _inputs(self, spans: list[tuple[Sequence, int, int]], before: Flight | None) -> torch.Tensor | None:
        """The step's input tokens on the device where some of them are `before`'s draws,
        not landed (None: every input is on the host, the forward takes them from there)."""
        if before is None or before.tokens is None:
            return None
        drawn = {(id(seq), len(seq.prompt) + mark): row for row, (seq, mark) in enumerate(zip(before.seqs, before.marks))}
        into, rows, at = [], [], 0
        for seq, start, n in spans:
            for pos in range(max(start, len(seq.prompt)), start + n):  # (only output tokens may be drawn)
                row = drawn.get((id(seq), pos))
                if row is not None:
                    into.append(at + pos - start)
                    rows.append(row)
            at += n
        if not rows:
            return None
        dev = self.engine.device
        if len(rows) == at:  # (decode rows alone: the draws are the inputs, as they lie or picked)
            return before.tokens if rows == list(range(len(before.tokens))) else before.tokens[on_device(rows, dev)]
        tokens = [t for seq, start, n in spans for t in seq.tokens(start, start + n)]
        if tokens.count(PLACEHOLDER) != len(rows):  # (a draw neither landed nor in flight: a bookkeeping fault)
            raise RuntimeError("a step's inputs hold a placeholder that no draw in flight fills")
        fed = on_device([max(t, 0) for t in tokens], dev)
        return fed.index_copy_(0, on_device(into, dev), before.tokens.index_select(0, on_device(rows, dev)))

    def _land(self, flight: Flight) -> list[Output]:
        """Take `flight`'s draws on the host, in place of its placeholders; key the blocks it
        filled. Sequences ended meanwhile (a stop in the step before, an abort) drew for nothing."""
        e = self.engine
        if flight.kept is not None:
            return land_drafted(e, flight, self.flight)
        for seq, start, n in flight.spans:
            if not seq.finished and seq.blocks and start + n <= seq.computed:  # (else: preempted since)
                e.blocks.cache_full_blocks(seq, upto=start + n)
        if not flight.seqs:
            return []
        drawn = unpack(flight.seqs, flight.landed(e.clock), flight.n_top)
        outputs = []
        for seq, mark, (token, logprob, top) in zip(flight.seqs, flight.marks, drawn):
            if seq.finished:
                continue
            try:
                if seq in flight.faults:
                    raise flight.faults[seq]
                outputs.append(e.took(seq, mark, token, logprob, top))
            except SequenceFault as fault:
                outputs.append(e.failed(seq, fault))
        return outputs


