"""A request as the engine sees it: prompt, generated tokens, cache blocks, progress."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from preload.worker.engine.sampling_params import SamplingParams, draw_seed

_ids = itertools.count()


@dataclass(frozen=True)
class CacheSource:
    """Where a sequence's cached latents come from; only blocks of one source are shared
    (block_manager.py), and the fields are kept apart in the key."""

    fingerprint: str  # the weights
    cache_salt: str | None = None  # the request's (an OpenAI-API extension, as vLLM's)
    adapter: str | None = None  # a LoRA adapter's name, once there are any


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
    prompt_logprobs: list[float | None] | None = None  # log p(prompt[i] | prompt[:i]), when asked
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank among all (1: the most likely)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # the n most likely, when n > 0 are asked
    blocks: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    cache_source: CacheSource = CacheSource("")  # given by the engine (engine.add)
    computed: int = 0
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the pending one (speculative.py)
    draft_probs: list = field(default_factory=list)  # the drafter's distribution for each (sampled requests)
    # Drafts still on the device (speculative.Drafter.chain): the tensor they lie in and
    # the index of each; `drafts` holds placeholders until they are judged or read.
    draft_at: tuple[torch.Tensor, list[int]] | None = None
    # Drafts verified by a step launched ahead and not landed (drafts_ahead.py): each may be
    # kept, so up to this many tokens past `computed` may be in the cache already.
    unsure: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when it first entered the running batch (time.monotonic)
    cached_tokens: int = 0  # of its prompt, found in the prefix cache then
    last_step: int = 0  # the scheduler's count of the last step that computed it (turns, when capped)
    generator: torch.Generator | None = None  # a seeded request's own, on the engine's device (engine.add)
    matcher: object | None = None  # structured output: its grammar's llguidance matcher (engine.add)

    def __post_init__(self):
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]  # nothing predicts the first token
            if self.params.prompt_logprobs:
                self.prompt_top_logprobs = [None]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole list."""
        p, n = len(self.prompt), len(self)
        out = self.prompt[start:end] + self.output[max(start - p, 0) : max(end - p, 0)]
        if end <= n:
            return out
        self.resolve_drafts()  # (past the end: the drafts a speculative step feeds after the pending token)
        return out + self.drafts[max(start - n, 0) : end - n]

    def resolve_drafts(self) -> None:
        """Bring drafts left on the device to the host (a wait for the GPU: the engine's
        steps read them on the device, and judging them brings them with its one copy)."""
        if self.draft_at is not None:
            flat, at = self.draft_at
            self.set_drafts(flat[at].tolist())

    def set_drafts(self, values: list[int]) -> None:
        """The values of the drafts left on the device, in order."""
        self.drafts[:] = values
        self.draft_at = None

    def generator_at(self, index: int) -> torch.Generator | None:
        """A seeded request's generator, set for the draws of its output token `index`
        (sampling_params.draw_seed); None for the others (they draw from the device's)."""
        if self.generator is None or self.params.seed is None:  # (a generator given without a seed draws on)
            return self.generator
        return self.generator.manual_seed(draw_seed(self.params.seed, index))

    def keep_drafts(self, n: int) -> None:
        del self.drafts[n:], self.draft_probs[n:]
        if self.draft_at is not None:
            del self.draft_at[1][n:]
            if not self.drafts:
                self.draft_at = None

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
