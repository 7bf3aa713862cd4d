"""Driving an engine by hand, as the worker's engine thread does: step until its work is
done, collecting each sequence's Outputs."""

from __future__ import annotations

from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText, with_text
from preload.worker.engine.sequence import Sequence


def run_to_end(engine, seqs: list[Sequence], each_step=None) -> dict[int, Output]:
    """Add `seqs` (checked first) and step `engine` until it has no work; each sequence's
    merged Output by id, with its text (output_text.py). `each_step(outputs)`: called after
    every step with the Outputs so far (it may add sequences: give them a list in `outputs`
    first; they get their text too)."""
    for seq in seqs:
        engine.check(seq)
        engine.add(seq)
    texts = {seq.id: (seq, OutputText(engine.tokenizer, seq.params)) for seq in seqs}
    outputs: dict[int, list[Output]] = {seq.id: [] for seq in seqs}
    while engine.has_work():
        for seq in engine.scheduler.waiting:  # (where each_step's additions are, before their first step)
            texts.setdefault(seq.id, (seq, OutputText(engine.tokenizer, seq.params)))
        for out in with_text(engine, texts, engine.step()):
            outputs[out.seq_id].append(out)
        if each_step is not None:
            each_step(outputs)
    return {seq.id: Output.merge(outputs[seq.id]) for seq in seqs}
