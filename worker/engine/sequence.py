"""A request as the engine sees it: prompt, generated tokens, cache blocks, progress."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from preload.worker.engine.sampler import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`computed` counts the tokens whose latents are in the cache: the engine's next
    step feeds tokens[computed:], a whole prompt chunk or, once decoding, the one
    token sampled last. Preemption frees the blocks and resets `computed` to 0; the
    generated tokens stay and are recomputed as part of the prefix."""

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
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.params.prompt_logprobs:
            self.prompt_logprobs = [None]  # nothing predicts the first token
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

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
