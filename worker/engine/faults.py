"""Whose fault is it: one sequence's, or the engine's.

After the batched forward, each sequence's own work (sampling, penalties, logprobs,
detokenizing, stop strings) runs in a `stage`. What fails there can only have come from
that sequence's parameters or text, so it ends that sequence alone: the engine finishes
it with the error (naming the stage) and steps on for the others. We cannot prove the
client was at fault, so the client hears a server error, not a 4xx; input we can judge
up front is refused before it gets here (SamplingParams, Engine.check).

Some failures mean the process or the device is in trouble whichever sequence met them:
they pass through any stage and stop the engine, and the worker is replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENGINE_FAULTS = (
    torch.AcceleratorError,  # a CUDA error: the context may be poisoned for every request
    torch.OutOfMemoryError,  # device memory
    MemoryError,  # host memory
)


class SequenceFault(Exception):
    """One sequence's own work failed in `stage`."""

    refused = False  # the request's own fault (RequestRefused: a 400), not the server's

    def __init__(self, stage: str, cause: Exception):
        super().__init__(f"{stage} failed for this request: {type(cause).__name__}: {cause}")
        self.stage = stage


class GrammarRefused(SequenceFault):
    """The request's grammar cannot go on (past llguidance's limits, somewhere its first
    step did not reach: grammar.py checks that one at admission): its own fault."""

    refused = True

    def __init__(self, why: str):
        Exception.__init__(self, f"structured output: the grammar cannot go on: {why}")
        self.stage = "structured output"


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Run one stage of a sequence's own work: its exceptions become SequenceFault(name)
    (the innermost stage's name, when stages nest)."""
    try:
        yield
    except (SequenceFault, *ENGINE_FAULTS):
        raise
    except Exception as e:  # noqa: BLE001 - anything else is this sequence's alone (see above)
        raise SequenceFault(name, e) from e
