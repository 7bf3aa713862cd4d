"""A request as the engine sees it: prompt, generated tokens, cache blocks, progress."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from preload.worker.engine.detokenizer import Detokenizer
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.stop_strings import StopStrings

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`computed` counts the tokens whose latents are in the cache: the engine's next
    step feeds the tokens from `computed` on: a whole prompt chunk or, once decoding, the one
    token sampled last. Preemption frees the blocks and resets `computed` to 0; the
    generated tokens stay and are recomputed as part of the prefix.

    Only the engine thread changes a sequence once it is submitted; others learn of
    its progress through Outputs (output.py)."""

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when it first entered the running batch (time.monotonic)
    generator: torch.Generator | None = None  # a seeded request's own, on the engine's device (engine.add)
    detokenizer: Detokenizer | None = None  # given by the engine, which holds the tokenizer
    matcher: object | None = None  # structured output: its grammar's llguidance matcher (engine.add)
    stop_strings: StopStrings = field(init=False)

    def __post_init__(self):
        if self.params.prompt_logprobs:
            self.prompt_logprobs = [None]  # nothing predicts the first token
        self.stop_strings = StopStrings(self.params.stop)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole list."""
        p = len(self.prompt)
        return self.prompt[start:end] + self.output[max(start - p, 0) : max(end - p, 0)]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self) - self.computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still scoring the prompt (a preempted sequence does not score it twice)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
