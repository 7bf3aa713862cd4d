"""Choosing the next token from logits: penalties, temperature, top-k, top-p."""

from __future__ import annotations

import torch

from preload.worker.engine.sampling_params import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    outside[..., 0] = False  # the most likely token stays, even when top_p rounds to 0 in float32
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def apply_penalties(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: subtract presence once per token seen, frequency per occurrence."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1]).to(logits)
    return logits - presence * (counts > 0).to(logits) - frequency * counts


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           generated: list[int] = ()) -> int:
    """One token id from float32 logits [V]; `generated`: the sequence's tokens so far (for penalties)."""
    logits = apply_penalties(logits, generated, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
