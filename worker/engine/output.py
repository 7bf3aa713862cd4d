"""What the engine tells a request after a step: an Output per sequence that advanced.

Outputs are deltas built by the engine thread and handed over whole, so a reader on
another thread never looks at a Sequence while the engine changes it. A reader that
fell behind merges what has queued up (`Output.merge`); merging every Output of a
sequence gives its whole result.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Output:
    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of token_ids, when the request asked for logprobs
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # likewise, when it asked for n > 0
    # New text that is final: never half a character, never text that might begin a
    # stop string; cut before the stop string that finished the sequence.
    text: str = ""
    finish_reason: str | None = None  # "stop" or "length" once the sequence is done
    prompt_logprobs: list[float | None] | None = None  # with the first token, when asked
    error: str | None = None  # the sequence failed (faults.py) and is finished
    prompt_ranks: list[int | None] | None = None  # with prompt_logprobs (Sequence's)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # likewise, when n > 0 are asked
    cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache held
    refused: bool = False  # with an error: the request's own fault (its grammar), a 400 rather than a 500
    # When each engine step's tokens in it reached the server (time.monotonic()): a reader that
    # lags gets several steps merged, and the metrics still time each step, as vLLM's do.
    landed: tuple[float, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def land(self, at: float) -> None:
        """Record that this step's tokens reached the server at `at` (a step without any: none)."""
        self.landed = (at,) if self.token_ids else ()

    @classmethod
    def merge(cls, outputs: list[Output]) -> Output:
        """One Output saying what `outputs` (consecutive, of one sequence) say together."""
        if len(outputs) == 1:
            return outputs[0]
        last = outputs[-1]
        return cls(
            last.seq_id,
            [t for o in outputs for t in o.token_ids],
            [lp for o in outputs for lp in o.logprobs],
            [top for o in outputs for top in o.top_logprobs],
            "".join(o.text for o in outputs),
            last.finish_reason,
            next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
            last.error,
            next((o.prompt_ranks for o in outputs if o.prompt_ranks is not None), None),
            next((o.prompt_top_logprobs for o in outputs if o.prompt_top_logprobs is not None), None),
            next((o.cached_tokens for o in outputs if o.cached_tokens is not None), None),
            last.refused,
            tuple(t for o in outputs for t in o.landed),
        )
