"""Choosing the next token from logits: greedy, temperature, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the first token always stays
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from float32 logits [V]."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
