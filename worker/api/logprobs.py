"""A prompt's log-probs as vLLM's API gives them back.

The engine scores each prompt token once (host_logprobs.score_prompt): its log-prob, its rank
among all tokens, and the n most likely at that position (n: what the request asked).
Nothing predicts the first token: its entry is null, in both shapes below.
"""

from __future__ import annotations

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.engine.output import Output


def prompt_logprobs_entries(tokenizer: Tokenizer, prompt: list[int], out: Output) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}
    for the token itself and the n most likely."""
    entries: list[dict | None] = [None]
    tops = out.prompt_top_logprobs or [None] * len(prompt)
    for token, lp, rank, top in zip(prompt[1:], out.prompt_logprobs[1:], out.prompt_ranks[1:], tops[1:]):
        entry = {str(token): _logprob(tokenizer, token, lp, rank)}
        for r, (t, v) in enumerate((top or {}).items(), 1):
            entry.setdefault(str(t), _logprob(tokenizer, t, v, r))
        entries.append(entry)
    return entries


def echoed_top_logprobs(tokenizer: Tokenizer, prompt: list[int], out: Output) -> list[dict[str, float] | None]:
    """/v1/completions' `top_logprobs` of an echoed prompt: per token, {text: log-prob} of
    the n most likely and of the token itself (what lm-eval reads to tell whether a
    continuation is the greedy one)."""
    tops = out.prompt_top_logprobs or [{}] * len(prompt)
    return [None] + [{tokenizer.token_text(t): v for t, v in (top or {}).items()} | {tokenizer.token_text(token): lp}
                     for token, lp, top in zip(prompt[1:], out.prompt_logprobs[1:], tops[1:])]


def _logprob(tokenizer: Tokenizer, token: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token)}
