"""Where an engine's steps go: how many of each kind ran and their wall time, and how
long the host waited on the GPU for the tokens of steps launched ahead (pipeline.py).

Three kinds: `prompt` (the step carries prompt tokens, with or without decode rows
beside them, launched ahead or not), `decode` (one token a sequence, launched from the
host's tokens) and `decode_ahead` (launched before the previous step's tokens reached
the host). A `decode_ahead` step whose time is mostly the wait is bound by the GPU; one
that waits little is bound by the host's work between steps. A `decode` step's host work
is not hidden, so many of them beside few `decode_ahead` ones say the pipeline stops often.

The totals go to the worker's /metrics (preload_engine_steps, _step_seconds,
_gpu_wait_seconds) and `preload bench serve` reads them around its run.
"""

from __future__ import annotations

import time

KINDS = ("prompt", "decode", "decode_ahead")


class StepClock:
    def __init__(self):
        self.steps = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.gpu_wait = 0.0  # seconds the host waited on a launched-ahead step's tokens
        self.kind: str | None = None  # what the step being timed turned out to be
        self._started = 0.0

    def start(self) -> None:
        self.kind, self._started = None, time.perf_counter()

    def stop(self) -> None:
        """The step timed since start() ran as `kind` (set meanwhile); none ran if unset."""
        if self.kind is not None:
            self.steps[self.kind] += 1
            self.seconds[self.kind] += time.perf_counter() - self._started

    def totals(self) -> tuple:
        """(steps by kind..., seconds by kind..., gpu_wait), in KINDS' order: EngineStats' fields."""
        return (*(self.steps[k] for k in KINDS), *(self.seconds[k] for k in KINDS), self.gpu_wait)
