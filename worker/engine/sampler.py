"""Choosing the next token from logits: penalties, temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means all tokens
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely
    prompt_logprobs: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the first token always stays
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def apply_penalties(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: subtract presence once per token seen, frequency per occurrence."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1]).to(logits)
    return logits - presence * (counts > 0).to(logits) - frequency * counts


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, generated: list[int] = ()) -> int:
    """One token id from float32 logits [V]."""
    logits = apply_penalties(logits, list(generated), params.presence_penalty, params.frequency_penalty)
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
