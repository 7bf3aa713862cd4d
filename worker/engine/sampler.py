"""Choosing the next token: penalties, temperature, top-k, min-p, top-p, on the device,
for the whole batch at once.

`sample_batch` is what the engine runs (and `sample_rows`, its draws, the drafter's): a
handful of tensor operations over the batch's log-probs, wherever they are (the GPU, or
the CPU). Sampling draws one exponential variate per token and takes argmax(p / E): that
picks token i with probability p_i, like a multinomial draw, without a cumulative sum or
a host round trip. Rows with a seed draw from their own generator, the others from the
device's.

`sample` is the one-row reference: the engine falls back to it, row by row, when a
batch fails, so that the one request at fault fails alone; tests hold the batch to it.
`steer` comes first for both: what a request asks of the logits beyond the penalties
(logit_bias, repetition_penalty, min_tokens).

A step launched ahead (pipeline.py) draws before the token drawn in the step before it has
reached the host: that token is a placeholder (a negative id) at the end of the output
the host passes, and its value is in `pending`, on the device, which the penalties count
in its place; nothing waits for it.
"""

from __future__ import annotations

import torch

from preload.worker.engine.grammar import allowed
from preload.worker.model.host_values import on_device, to_device
from preload.worker.engine.sampling_params import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p
    (a number, or one per row [N, 1])."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    outside[..., 0] = False  # the most likely token stays, even when top_p rounds to 0 in float32
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def apply_penalties(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: subtract presence once per token seen, frequency per occurrence."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    counts = torch.bincount(on_device(generated, logits.device), minlength=logits.shape[-1]).to(logits)
    return logits - presence * (counts > 0).to(logits) - frequency * counts


def landed(tokens: list[int]) -> list[int]:
    """`tokens` without the placeholder of a draw not yet on the host (a step launched ahead)."""
    return tokens[:-1] if tokens and tokens[-1] < 0 else tokens


def in_flight(outputs: list[list[int]], pending: torch.Tensor | None) -> list[int]:
    """The rows whose output ends with a placeholder, its value in `pending` (on the device)."""
    return [] if pending is None else [i for i, out in enumerate(outputs) if out and out[-1] < 0]


def steer(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
          stop_ids: frozenset[int], matchers: list | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [N, V] as the requests ask them changed before sampling (a copy, if any
    row asks): logit_bias added; repetition_penalty over the tokens of the prompt and the
    output, as vLLM applies it (a positive logit divided by it, a negative one multiplied);
    until min_tokens are out, the stop tokens (`stop_ids` and the request's) at -inf; with
    a grammar (matchers[i], grammar.py), every token it does not allow next at -inf.
    `pending`: each row's draw not yet in its output, where that ends with its placeholder."""
    rows = [i for i, p in enumerate(params) if p.steers]
    if not rows:
        return logits
    logits, dev = logits.clone(), logits.device
    waiting = set(in_flight(outputs, pending))
    for i in rows:
        p, row = params[i], logits[i]
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            row[on_device(list(ids), dev)] += on_device(list(bias), dev, row.dtype)
        if p.repetition_penalty != 1.0:
            seen = on_device(sorted(set(prompts[i]) | set(landed(outputs[i]))), dev, torch.long)
            if i in waiting:  # (twice, if it is among them: both places get the same value)
                seen = torch.cat([seen, pending[i : i + 1]])
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        grammar = allowed(matchers[i], row.shape[-1]) if matchers is not None and matchers[i] is not None else None
        if len(outputs[i]) < p.min_tokens:
            stops = torch.tensor(sorted(stop_ids | set(p.stop_token_ids)), dtype=torch.long)
            # A grammar that allows only stopping wins over min_tokens: the output must parse.
            if grammar is None or grammar.clone().index_fill_(0, stops, False).any():
                # (no wait: a step launched ahead draws here; an item assigned would copy a host scalar)
                row.index_fill_(0, to_device(stops, dev), float("-inf"))
        if grammar is not None:
            row.masked_fill_(~to_device(grammar, dev), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           generated: list[int] = ()) -> int:
    """One token id from float32 logits [V]; `generated`: the sequence's tokens so far (for penalties)."""
    logits = apply_penalties(logits, generated, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(distribution(logits, params), 1, generator=generator))


def min_p_filter(x: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Logits [..., V] without the tokens less likely than min_p times the most likely one
    (a number, or one per row [N, 1]): p_i < min_p * p_max is x_i < x_max + log(min_p),
    no softmax needed (and min_p 0 masks nothing). Ratios of probabilities do not change
    under top-k, so vLLM's order (min-p, then top-k) gives the same."""
    floor = x.max(-1, keepdim=True).values + torch.as_tensor(min_p, device=x.device, dtype=x.dtype).log()
    return x.masked_fill(x < floor, float("-inf"))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a sampled request draws from, for logits [..., V]: temperature, then top-k,
    min-p, then top-p (`sample`'s, and speculative decoding's acceptance test's)."""
    x = logits / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(params.top_k, dim=-1).values[..., -1:], float("-inf"))
    if params.min_p > 0.0:
        x = min_p_filter(x, params.min_p)
    probs = x.softmax(-1)
    return top_p_filter(probs, params.top_p) if params.top_p < 1.0 else probs


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 generated: list[list[int]], pending: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [N] (on logits' device) for float32 logits [N, V], one row per sequence:
    its params, its generator (None: the device's), its tokens so far (for penalties; a
    placeholder last: its value in `pending`, as `steer` takes it)."""
    n, vocab = logits.shape
    dev = logits.device

    def column(values: list) -> torch.Tensor:
        return on_device(values, dev, torch.float32)[:, None]

    penalized = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if penalized:
        logits = logits.clone()
        seen = {i: landed(generated[i]) for i in penalized}
        rows = on_device([i for i in penalized for _ in seen[i]], dev, torch.long)
        tokens = on_device([t for i in penalized for t in seen[i]], dev, torch.long)
        waiting = [i for i in in_flight(generated, pending) if i in seen]
        if waiting:
            waiting = on_device(waiting, dev, torch.long)
            rows, tokens = torch.cat([rows, waiting]), torch.cat([tokens, pending[waiting]])
        counts = torch.zeros(n, vocab, device=dev).index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32),
                                                              accumulate=True)
        presence = column([p.presence_penalty for p in params])
        frequency = column([p.frequency_penalty for p in params])
        logits -= presence * (counts > 0) + frequency * counts
    return sample_rows(logits, params, generators)[0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token ids [N], on logits' device; the distributions the sampled rows drew from,
    [S, V] float32 in row order, or None if every row is greedy) for logits [N, V] that
    nothing more shapes: the argmax for greedy rows, argmax(p / E) for the others, E from
    the row's generator where it has one."""
    greedy = logits.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return greedy, None
    rows = on_device(drawn, logits.device)
    probs = distributions(logits[rows].float(), [params[i] for i in drawn])
    noise = torch.empty_like(probs).exponential_()
    for row, i in enumerate(drawn):
        if generators[i] is not None:
            noise[row].exponential_(generator=generators[i])
    return greedy.index_put((rows,), draw(probs, noise)), probs


def distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`distribution` for logits [N, V], row i with params[i], in a handful of operations
    for the whole batch."""
    vocab, dev = logits.shape[-1], logits.device

    def column(values: list) -> torch.Tensor:
        return on_device(values, dev, torch.float32)[:, None]

    x = logits / column([p.temperature for p in params])
    k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(k) < vocab:
        kth = x.topk(max(k), dim=-1).values.gather(1, on_device(k, dev)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        x = min_p_filter(x, column([p.min_p for p in params]))
    probs = x.softmax(-1)
    if any(p.top_p < 1.0 for p in params):
        probs = top_p_filter(probs, column([p.top_p for p in params]))
    return probs


def draw(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A token per row of probs [N, V]: argmax(p / E), token i with probability p_i."""
    return (probs / noise).argmax(-1)
