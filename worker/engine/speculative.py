"""Speculative decoding with the checkpoint's MTP layer as the drafter.

`--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` (vLLM's shape).
After each step the MTP layer catches up on the positions the target just computed: at
position i it reads the target's hidden state and the token at i+1, writes its own latent
cache layer (one more layer of the same paged cache) and, at the last position, predicts
the token after the pending one: the first draft. It then runs on its own output k-1
more times for the next drafts. The next step feeds the pending token and the k drafts
through the target at once (one pass, k+1 rows) and keeps:

- greedy requests: the drafts while they equal the target's argmax, then the target's
  argmax at the first difference (or after the last draft): exactly the tokens decoding
  one by one gives;
- sampled requests: each draft d with probability min(1, p(d) / q(d)) (p the target's
  distribution after temperature, top-k and top-p; q the drafter's, drawn the same way),
  at the first rejection a token from max(0, p - q) renormalized, after k acceptances one
  from p: the target's distribution, exactly (Leviathan et al., 2023).

The KV of rejected drafts is left where it is: context lengths never reach it, and the
next tokens overwrite it. Only requests whose logits nothing else changes speculate (no
grammar, bias, penalties, log-probs); the others decode one token a step beside them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from preload.worker.engine.sampler import top_p_filter
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.model.kv_cache import AttentionMeta


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int

    @classmethod
    def parse(cls, text: str | None) -> SpecConfig | None:
        """The JSON of --speculative-config; ValueError saying what is wrong."""
        if not text:
            return None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(d, dict) or set(d) - {"method", "num_speculative_tokens"}:
            raise ValueError(f"--speculative-config takes method and num_speculative_tokens, got {text}")
        k = d.get("num_speculative_tokens")
        if d.get("method") != "mtp":
            raise ValueError(f"--speculative-config method {d.get('method')!r}: only 'mtp' (the checkpoint's own layer)")
        if not isinstance(k, int) or not 1 <= k <= 8:
            raise ValueError(f"num_speculative_tokens must be 1 to 8, got {k!r}")
        return cls("mtp", k)


def speculates(seq: Sequence) -> bool:
    """Whether nothing but temperature, top-k and top-p shapes this request's draws."""
    p = seq.params
    return (p.grammar is None and not p.steers and not p.presence_penalty and not p.frequency_penalty
            and p.logprobs is None and not p.prompt_logprobs)


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from, for rows [N, V] of logits."""
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(p.top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = x.softmax(-1)
    return top_p_filter(probs, p.top_p) if p.top_p < 1.0 else probs


def draft_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft per row of MTP logits: the argmax for greedy requests; for sampled ones a
    draw from q (their own generator), with q kept for the acceptance test."""
    tokens = logits.argmax(-1).tolist()
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            qs[i] = target_probs(logits[i], seq.params)
            tokens[i] = int(torch.multinomial(qs[i], 1, generator=seq.generator))
    return tokens, qs


def accept(rows: torch.Tensor, seq: Sequence) -> list[int]:
    """The tokens a verify pass gives `seq`: rows [k+1, V] are the target's logits after
    the pending token and each of its k drafts (seq.drafts, seq.draft_probs)."""
    drafts = seq.drafts
    if seq.params.greedy:
        best = rows.argmax(-1).tolist()
        n = next((j for j, d in enumerate(drafts) if best[j] != d), len(drafts))
        return drafts[:n] + [best[n]]
    gen = seq.generator
    out = []
    for j, d in enumerate(drafts):
        p, q = target_probs(rows[j], seq.params), seq.draft_probs[j]
        u = float(torch.rand((), generator=gen, device=rows.device)) if gen is not None else float(torch.rand(()))
        if u * float(q[d]) < float(p[d]):  # accepted with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        residual = (p - q).clamp_(min=0)
        total = float(residual.sum())
        fallback = residual / total if total > 0 else p
        return out + [int(torch.multinomial(fallback, 1, generator=gen))]
    return out + [int(torch.multinomial(target_probs(rows[len(drafts)], seq.params), 1, generator=gen))]


class Drafter:
    """Runs the MTP layer after each step: it catches up on the positions the target just
    computed for the speculating sequences and drafts k tokens for those that decode next."""

    def __init__(self, model, cache, blocks, config: SpecConfig, device: torch.device):
        self.model, self.cache, self.blocks, self.k, self.device = model, cache, blocks, config.num_speculative_tokens, device
        self.drafted = 0  # draft tokens proposed and accepted so far (metrics)
        self.accepted = 0

    def draft(self, spans: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """spans: (sequence, start, tokens fed) of the step just run, whose target hidden
        states are `hidden` [T, D], in order."""
        catch, offset = [], 0
        for seq, start, n in spans:
            m = seq.computed - start  # positions start..computed-1 hold the target's latents now
            if m > 0 and not seq.finished and speculates(seq):
                catch.append((seq, start, m, offset))
            offset += n
        if not catch:
            return
        h = torch.cat([hidden[off : off + m] for _, _, m, off in catch])
        nxt = [t for seq, start, m, _ in catch for t in seq.tokens(start + 1, start + m + 1)]
        meta = AttentionMeta.build([(start, m, seq.blocks) for seq, start, m, _ in catch], self.blocks.block_size,
                                   self.device)
        x, logits = self.model.mtp_step(h, torch.tensor(nxt, device=self.device), meta, self.cache)
        ends = torch.tensor([m for _, _, m, _ in catch], device=self.device).cumsum(0) - 1
        decoding = [i for i, (seq, *_) in enumerate(catch) if seq.pending == 1]  # sampled this step: decodes next
        if not decoding:
            return
        seqs = [catch[i][0] for i in decoding]
        last = ends[torch.tensor(decoding, device=self.device)]
        x, logits = x[last], logits[last]
        for j in range(self.k):
            tokens, qs = draft_tokens(logits, seqs)
            for seq, t, q in zip(seqs, tokens, qs):
                seq.drafts.append(t)
                seq.draft_probs.append(q)
            if j == self.k - 1:
                break
            # The next draft: the MTP layer again, at the draft's position, on its own output.
            room = [i for i, seq in enumerate(seqs) if self._room(seq, seq.computed + j)]
            if not room:
                break
            seqs = [seqs[i] for i in room]
            index = torch.tensor(room, device=self.device)
            meta = AttentionMeta.build([(seq.computed + j, 1, seq.blocks) for seq in seqs], self.blocks.block_size,
                                       self.device)
            x, logits = self.model.mtp_step(x[index], torch.tensor([s.drafts[-1] for s in seqs], device=self.device),
                                            meta, self.cache)
        self.drafted += sum(len(catch[i][0].drafts) for i in decoding)

    def _room(self, seq: Sequence, position: int) -> bool:
        """Whether `seq` has (or can get) a cache slot at `position`."""
        if self.blocks.can_grow(seq, position + 1):
            self.blocks.grow(seq, position + 1)
            return True
        return False
