"""Driving an engine by hand, as the worker's engine thread does: step until its work is
done, collecting each sequence's Outputs."""

from __future__ import annotations

from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence


def run_to_end(engine, seqs: list[Sequence], each_step=None) -> dict[int, Output]:
    """Add `seqs` (checked first) and step `engine` until it has no work; each sequence's
    merged Output by id. `each_step(outputs)`: called after every step with the Outputs so
    far (it may add sequences: give them a list in `outputs` first)."""
    for seq in seqs:
        engine.check(seq)
        engine.add(seq)
    outputs: dict[int, list[Output]] = {seq.id: [] for seq in seqs}
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq_id].append(out)
        if each_step is not None:
            each_step(outputs)
    return {seq.id: Output.merge(outputs[seq.id]) for seq in seqs}
