"""A step's log-prob rows, what the host needs of them brought over in one copy: the drawn
tokens with their log-probs and the n most likely (`drawn_on_host`; or `pack` on the device
and `unpack` once the copy has landed, as a step launched ahead does: pipeline.py), and a
prompt's own scores (`score_prompt`: each token's log-prob, its rank, the n most likely).
Every column goes over as float64, which holds every token id exactly."""

from __future__ import annotations

import torch

from preload.worker.model.host_values import on_device
from preload.worker.engine.sequence import Sequence


def drawn_on_host(seqs: list[Sequence], rows: torch.Tensor, tokens: torch.Tensor) -> list[tuple]:
    """(token, log-prob or None, {id: log-prob} of the n most likely or None) per row,
    in one transfer to the host."""
    packed, n_top = pack(seqs, rows, tokens)
    return unpack(seqs, packed.tolist(), n_top)


def pack(seqs: list[Sequence], rows: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What the host needs of the drawn `tokens` in one tensor, so one copy (float64 holds
    every token id exactly): [token, its log-prob, top ids..., top log-probs...] per
    row, n_top of each (the most any of `seqs` asked for)."""
    n_top = max((s.params.logprobs or 0) for s in seqs)
    columns = [tokens[:, None], rows.gather(1, tokens[:, None])]
    if n_top:
        top = rows.topk(n_top, dim=-1)
        columns += [top.indices, top.values]
    return torch.cat([c.double() for c in columns], 1), n_top


def unpack(seqs: list[Sequence], host: list[list[float]], n_top: int) -> list[tuple]:
    """`pack`'s rows, on the host, as `drawn_on_host` returns them."""
    out = []
    for seq, (token, lp, *top_cols) in zip(seqs, host):
        n = seq.params.logprobs
        tops = {int(t): v for t, v in zip(top_cols[:n], top_cols[n_top : n_top + n])} if n else None
        out.append((int(token), lp if n is not None else None, tops))
    return out


def score_prompt(seq: Sequence, start: int, n: int, rows: torch.Tensor) -> None:
    """Append to `seq`'s prompt scores those of rows [n, V], the log-probs after prompt
    tokens start..start+n-1: row i predicts prompt[start + i + 1]. A preempted sequence
    recomputes rows whose scores it already has: those are skipped."""
    lo, hi = len(seq.prompt_logprobs) - 1 - start, min(n, len(seq.prompt) - 1 - start)
    targets = on_device(seq.prompt[start + 1 + lo : start + 1 + hi], rows.device, torch.long)
    scored = rows[lo:hi]
    lps = scored.gather(1, targets[:, None])
    columns = [lps, (scored > lps).sum(1, keepdim=True) + 1]
    k = seq.params.prompt_logprobs
    if k:
        top = scored.topk(k, dim=-1)
        columns += [top.indices, top.values]
    for lp, rank, *top in torch.cat([c.double() for c in columns], 1).tolist():
        seq.prompt_logprobs.append(lp)
        seq.prompt_ranks.append(int(rank))
        if k:
            seq.prompt_top_logprobs.append({int(t): v for t, v in zip(top[:k], top[k:])})
