"""Speculative decoding: the checkpoint's MTP layer, or a separate small model, drafts.

`--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` (vLLM's shape), or
`{"method": "draft_model", "model": DIR | "state_dir": DIR, "num_speculative_tokens": k}`
for a small model of the same vocabulary, loaded beside the target or attached zero-copy
from another daemon. After each step the MTP layer catches up on the positions the target
just computed: at position i it reads the target's hidden state and the token at i+1,
writes its own latent cache layer (one more layer of the same paged cache) and, at the
last position, predicts the token after the pending one: the first draft. It then runs on
its own output k-1 more times for the next drafts. A draft model does the same from the
tokens, in a cache of its own that the same block tables index. The next step feeds the
pending token and the k drafts through the target at once (one pass, k+1 rows) and keeps:

- greedy requests: the drafts while they equal the target's argmax, then the target's
  argmax at the first difference (or after the last draft): exactly the tokens decoding
  one by one gives;
- sampled requests: each draft d with probability min(1, p(d) / q(d)) (p the target's
  distribution after temperature, top-k and top-p; q the drafter's, drawn the same way),
  at the first rejection a token from max(0, p - q) renormalized, after k acceptances one
  from p: the target's distribution, exactly (Leviathan et al., 2023).

A step's drafts are judged together on the device, greedy and sampled alike (`judge`):
one copy to the host a step, not one a draft.

The KV of rejected drafts is left where it is: context lengths never reach it, and the
next tokens overwrite it. Only requests whose logits nothing else changes speculate (no
grammar, bias, penalties, log-probs), and no seeded sampled ones (their tokens through
drafts would depend on the drafts, and so on the load); the others decode one token a
step beside them, a seeded one the tokens it draws without drafts.
The operator's logits processors (--logits-processors) apply to every request, so they
shape both sides: the drafter's rows before a draft is drawn (`shape`), and each of the
target's verified rows before the drafts are judged (the engine's), each row seeing the
drafts before it as generated tokens. A token they ban is never proposed, accepted or
emitted, and the outputs are those of decoding with the processors alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from preload.worker.engine.cuda_graphs import DecodeGraphs
from preload.worker.engine.faults import SequenceFault, stage
from preload.worker.model.host_values import all_on_device, on_device
from preload.worker.engine.sampler import distributions, draw, sample_rows
from preload.worker.engine.sequence import Sequence
from preload.worker.model.kv_cache import AttentionMeta


@dataclass(frozen=True)
class SpecConfig:
    """--speculative-config: the MTP layer, or a separate small model (a checkpoint dir
    loaded beside the target, or attached zero-copy from another daemon's state dir)."""

    method: str  # "mtp" or "draft_model"
    num_speculative_tokens: int
    model: str | None = None
    state_dir: str | None = None

    @classmethod
    def parse(cls, text: str | None) -> SpecConfig | None:
        """The JSON of --speculative-config; ValueError saying what is wrong."""
        if not text:
            return None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(d, dict) or set(d) - {"method", "num_speculative_tokens", "model", "state_dir"}:
            raise ValueError(f"--speculative-config takes method, num_speculative_tokens, model, state_dir; got {text}")
        k, method = d.get("num_speculative_tokens"), d.get("method") or ("draft_model" if "model" in d else None)
        if method not in ("mtp", "draft_model"):
            raise ValueError(f"--speculative-config method {method!r}: 'mtp' (the checkpoint's own layer) or 'draft_model'")
        if not isinstance(k, int) or not 1 <= k <= 8:
            raise ValueError(f"num_speculative_tokens must be 1 to 8, got {k!r}")
        where = [key for key in ("model", "state_dir") if isinstance(d.get(key), str) and d[key]]
        if (method == "draft_model") != (len(where) == 1) or set(d) & {"model", "state_dir"} - set(where):
            raise ValueError("method 'draft_model' takes one of model (a checkpoint dir) or state_dir (a daemon's);"
                             " 'mtp' takes neither")
        return cls(method, k, d.get("model"), d.get("state_dir"))


def check_drafter(spec: SpecConfig | None, target, draft) -> None:
    """ValueError unless the target and draft model can carry out `spec`."""
    if spec is None:
        return
    if spec.method == "mtp" and target.mtp is None:
        raise ValueError("--speculative-config method 'mtp': this checkpoint has no MTP layer")
    if spec.method == "draft_model":
        if draft is None:
            raise ValueError("--speculative-config method 'draft_model': no draft model given")
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) is not the target's "
                             f"({target.cfg.vocab_size})")


def speculates(seq: Sequence) -> bool:
    """Whether nothing but temperature, top-k and top-p shapes this request's draws, and no
    seed fixes them: a seeded request's tokens drawn through drafts would depend on the
    drafts, and so on the load (how many fit, preemptions), not on the seed alone."""
    p = seq.params
    return not p.shapes_logits and p.logprobs is None and p.prompt_logprobs is None and (p.greedy or p.seed is None)


def accept(rows: torch.Tensor, seq: Sequence) -> list[int]:
    """The tokens a verify pass gives `seq`: rows [k+1, V] are the target's logits after
    the pending token and each of its k drafts (seq.drafts, seq.draft_probs)."""
    return judge(rows, [seq])[0]


def judge(rows: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
    """`accept` for a step's verifying sequences at once, on the device, with one copy to
    the host: rows [R, V] are theirs in order, k_i + 1 each. A greedy sequence keeps its
    drafts while they equal the rows' argmax, then the argmax. A sampled one keeps draft j
    with probability min(1, p(d) / q(d)) (a uniform u: u q(d) < p(d)); the first one
    refused is replaced by a draw from max(0, p - q) renormalized (p where that is empty),
    and after k kept drafts the next token is drawn from p."""
    dev, ks = rows.device, [len(seq.drafts) for seq in seqs]
    firsts = list(accumulate((k + 1 for k in ks[:-1]), initial=0))  # each sequence's first row
    left = any(seq.draft_at is not None for seq in seqs)  # (drafts on the device: they come back with the copy)
    if all(seq.params.greedy for seq in seqs):  # (the argmax alone to the host: fewer launches than judged_on_device)
        chosen = rows.argmax(-1)
        best = torch.cat([chosen, drafts_on_device(seqs, dev)]).tolist() if left else chosen.tolist()
        resolve(seqs, best[len(chosen):])
        ns = [next((j for j, d in enumerate(seq.drafts) if best[f + j] != d), k) for seq, f, k in zip(seqs, firsts, ks)]
        return [seq.drafts[:n] + [best[f + n]] for seq, f, n in zip(seqs, firsts, ns)]
    n, last, d = judged_on_device(rows, seqs)
    got = torch.cat([n, last] + ([d] if left else [])).tolist()  # (the one copy)
    n_kept, last = got[: len(seqs)], got[len(seqs) : 2 * len(seqs)]
    resolve(seqs, got[2 * len(seqs) :])
    return [seq.drafts[:m] + [t] for seq, m, t in zip(seqs, n_kept, last)]


def judged_on_device(rows: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`judge`'s work left on the device: for each sequence the drafts it keeps and the token
    after them ([S] each), and every draft in order ([sum k]), with no wait for the GPU."""
    dev, ks = rows.device, [len(seq.drafts) for seq in seqs]
    firsts = list(accumulate((k + 1 for k in ks[:-1]), initial=0))  # each sequence's first row
    before = list(accumulate(ks[:-1], initial=0))  # each sequence's drafts before its own
    drawn = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    mine = accumulate((ks[i] + 1 for i in drawn[:-1]), initial=0)  # each drawn one's first row among theirs
    runs = draft_runs([(seq, 0, k) for seq, k in zip(seqs, ks)])
    at, flag_rows, flag_cols, first, own, judging, theirs, *values = all_on_device([
        [f + j for f, k in zip(firsts, ks) for j in range(k)],  # the rows judging a draft
        [i for i, k in enumerate(ks) for _ in range(k)], [j for k in ks for j in range(k)],  # each draft's flag
        firsts,
        # The drawn ones' rows alone ([Rs, V]), in order; `judging`: where their drafts' rows are
        # among them; `theirs`: their drafts in `kept`.
        [firsts[i] + j for i in drawn for j in range(ks[i] + 1)],
        [f + j for f, i in zip(mine, drawn) for j in range(ks[i])],
        [before[i] + j for i in drawn for j in range(ks[i])]] + [v for _, v in runs], dev)
    chosen = rows.argmax(-1)  # each row's token: greedy rows' now, sampled rows' below
    d = joined(runs, values)  # every draft, in order
    kept = chosen[at] == d
    if drawn:
        p = distributions(rows[own].float(), [seqs[i].params for i in drawn for _ in range(ks[i] + 1)])
        noise, u = torch.empty_like(p).exponential_(), torch.rand(len(judging), device=dev)
        q = torch.stack([q for i in drawn for q in seqs[i].draft_probs]).to(p)
        pd, dd = p[judging], d[theirs][:, None]
        residual = (pd - q).clamp_(min=0)
        total = residual.sum(-1, keepdim=True)
        p = p.index_put((judging,), torch.where(total > 0, residual / total, pd))
        chosen = chosen.index_put((own,), draw(p, noise))
        kept = kept.index_put((theirs,), u * q.gather(1, dd)[:, 0] < pd.gather(1, dd)[:, 0])
    flags = torch.zeros(len(seqs), max(ks, default=0) + 1, dtype=torch.long, device=dev)  # (a last 0: none past k)
    flags[flag_rows, flag_cols] = kept.long()
    n = flags.cumprod(-1).sum(-1)  # the drafts kept: those before the first refused
    return n, chosen[first + n], d


def judged_together(verifying: list[tuple[Sequence, int]], logprobs: torch.Tensor) -> dict[int, list[int]]:
    """{sequence id: its tokens} for a step's (sequence, its first row in logprobs), judged
    together; {} if that fails: then each is judged alone (`accept`), and a failure is the
    one sequence's."""
    if not verifying:
        return {}
    seqs = [seq for seq, _ in verifying]
    picked = [first + j for seq, first in verifying for j in range(len(seq.drafts) + 1)]
    try:
        with stage("speculative decoding"):  # (every row, a verify step's: no copy of them)
            rows = logprobs if picked == list(range(len(logprobs))) else logprobs[on_device(picked, logprobs.device)]
            return dict(zip((seq.id for seq in seqs), judge(rows, seqs)))
    except SequenceFault:
        return {}


def drafts_on_device(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """Every draft of `seqs`, in order, as one tensor on the device: those the drafter left
    there gathered where they lie, the host's copied in, none waited for."""
    runs = draft_runs([(seq, 0, len(seq.drafts)) for seq in seqs])
    return joined(runs, all_on_device([v for _, v in runs], device))


def fed_tokens(spans: list[tuple[Sequence, int, int]], device: torch.device) -> torch.Tensor:
    """The tokens a step feeds for (sequence, start, n) spans, in order, on the device: the
    drafts the drafter left there put in place there, so that the verify step is launched
    without waiting for them (they come to the host with the judging's one copy)."""
    host, at, ranges = [], [], []
    for seq, start, n in spans:
        end, known = start + n, len(seq)
        if seq.draft_at is None or end <= known:
            host += seq.tokens(start, end)
            continue
        host += seq.tokens(start, known)
        lo = max(start - known, 0)
        at += range(len(host), len(host) + end - known - lo)
        host += [0] * (end - known - lo)
        ranges.append((seq, lo, end - known))
    runs = draft_runs(ranges)
    tokens, at, *values = all_on_device([host, at] + [v for _, v in runs], device)
    if len(at):
        tokens[at] = joined(runs, values)
    return tokens


def draft_runs(ranges: list[tuple[Sequence, int, int]]) -> list[tuple[torch.Tensor | None, list[int]]]:
    """The drafts lo..hi-1 of each (sequence, lo, hi), in order, as runs of (the tensor the
    drafter left them in, their indices there), or (None, their values) for the host's."""
    runs: list[tuple[torch.Tensor | None, list[int]]] = []
    for seq, lo, hi in ranges:
        flat, values = seq.draft_at if seq.draft_at is not None else (None, seq.drafts)
        if runs and runs[-1][0] is flat:
            runs[-1][1].extend(values[lo:hi])
        else:
            runs.append((flat, list(values[lo:hi])))
    return runs


def joined(runs: list[tuple[torch.Tensor | None, list[int]]], values: list[torch.Tensor]) -> torch.Tensor:
    """`draft_runs`' drafts on the device, given each run's list there (`values`): a gather
    per run left on the device (one, for a step's drafts)."""
    out = [v if flat is None else flat[v] for (flat, _), v in zip(runs, values)]
    return torch.cat(out) if len(out) != 1 else out[0]


def resolve(seqs: list[Sequence], values: list[int]) -> None:
    """Fill the drafts left on the device of `seqs` from `values`: all their drafts, in order."""
    i = 0
    for seq in seqs:
        k = len(seq.drafts)
        if seq.draft_at is not None:
            seq.set_drafts(values[i : i + k])
        i += k


@dataclass
class Reach:
    """Where a drafter's chained steps go, for each of the sequences drafting: draft step j
    (0: the second draft) at `bases[i] + j + 1` as the host knows it, past that by
    `offsets[i]` on the device (None: 0), which is at most `slack[i]`. A step run from the
    host knows every position (`known`); one launched before the step in flight has landed
    knows them up to the drafts that step keeps (drafts_ahead.py)."""

    bases: list[int]
    slack: list[int]
    offsets: torch.Tensor | None = None

    @classmethod
    def known(cls, seqs: list[Sequence], shift: int) -> Reach:
        """Each sequence's own: its computed tokens, less `shift` (the MTP layer's 1)."""
        return cls([seq.computed - shift for seq in seqs], [0] * len(seqs))

    def of(self, picked: list[int]) -> Reach:
        """The reach of the sequences at `picked`."""
        if picked == list(range(len(self.bases))):  # (all of them, as a chain's steps mostly are: no copy)
            return self
        offsets = self.offsets
        if offsets is not None:
            offsets = offsets[on_device(picked, offsets.device, torch.long)]
        return Reach([self.bases[i] for i in picked], [self.slack[i] for i in picked], offsets)


class Drafter:
    """Runs after each step: the drafter catches up on the positions the target just
    computed for the speculating sequences, and drafts k tokens for those that decode
    next. The MTP layer reads the target's hidden states and keeps its latents in one more
    layer of the target's cache; a draft model reads the tokens and keeps its own cache,
    indexed by the same block tables."""

    def __init__(self, config: SpecConfig, blocks, device: torch.device, model, cache,
                 shape: Callable[[torch.Tensor, list[Sequence]], torch.Tensor] | None = None,
                 graphs: DecodeGraphs | None = None, scratch_block: int = 0):
        """`model` and `cache`: the target and its cache (MTP), or the draft model and its own.
        `shape`: the drafter's logits of these sequences as the operator's processors make
        them (None: no processors). A failure there or in drawing stops their drafting for
        the step; it is theirs alone (their sampling meets it again), never the engine's.
        `graphs`: the drafter's steps as CUDA graphs (cuda_graphs.py, a row per token fed;
        padding rows in `scratch_block`), replayed where they fit; else steps run eagerly."""
        self.k, self.blocks, self.device, self.model, self.cache = config.num_speculative_tokens, blocks, device, model, cache
        self.shape, self.graphs, self.scratch_block = shape, graphs, scratch_block
        self.mtp = config.method == "mtp"
        # Draft tokens verified so far, and those of them the target accepted (metrics): a
        # draft never verified (its sequence ended or was preempted first, or no room or
        # budget was left for it) counts in neither.
        self.drafted = 0
        self.accepted = 0

    def run(self, hidden: torch.Tensor | None, tokens: list[int] | torch.Tensor, spans: list[tuple[int, int, list[int]]],
             shift: torch.Tensor | None = None):
        """(hidden states to chain on, or None; logits, or log-probs from a graph: the same
        draws) of the drafter over the spans (start, tokens, blocks) of a flat batch; the
        tokens from the host, or already on the device (chained drafts). `shift`: each row's
        position past its span's, known on the device only (a step launched ahead: graphs only)."""
        g, ready = self.graphs, isinstance(tokens, torch.Tensor)
        if g is not None and g.holds(len(tokens), [blocks for *_, blocks in spans]):
            g.ensure(self.cache, self.scratch_block, [g.bucket(len(tokens))])  # (a lazy start's bucket: at first use)
            rows = [(start + j, blocks) for start, n, blocks in spans for j in range(n)]
            logprobs, x = g.replay_rows([(0 if ready else t, pos, blocks) for t, (pos, blocks) in zip(tokens, rows)],
                                        self.scratch_block, tokens=tokens if ready else None, hidden=hidden, shift=shift)
            return (x if self.mtp else None), logprobs
        if shift is not None:
            raise RuntimeError("a drafter step launched ahead does not fit its graphs (a bookkeeping fault)")
        meta = AttentionMeta.build(spans, self.blocks.block_size, self.device)
        ids = tokens if ready else on_device(tokens, self.device, torch.long)
        if self.mtp:
            return self.model.mtp_step(hidden, ids, meta, self.cache)
        return None, self.model.logits(self.model.forward(ids, meta, self.cache))

    def draft(self, spans: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """spans: (sequence, start, tokens fed) of the step just run, whose target hidden
        states are `hidden` [T, D], in order."""
        catch, offset = [], 0  # (sequence, start, rows the drafter reads, offset in hidden, decodes next)
        for seq, start, n in spans:
            m = seq.computed - start  # positions start..computed-1 hold the target's latents now
            # Every sequence's, drafting or not: its full blocks may be shared (the prefix cache)
            # with one that drafts, which then needs the drafter's latents of them too.
            if m > 0 and not seq.finished:
                # The MTP layer at position i reads the token at i+1; a draft model reads position
                # i's own token, so it also reads the pending one, at `computed`, if it is to draft.
                decodes = speculates(seq) and seq.pending == 1 and (self.mtp or self.room(seq, seq.computed))
                catch.append((seq, start, m + (decodes and not self.mtp), offset, decodes))
            offset += n
        if not catch:
            return
        shift = 1 if self.mtp else 0
        tokens = [t for seq, start, r, _, _ in catch for t in seq.tokens(start + shift, start + shift + r)]
        h = torch.cat([hidden[off : off + r] for _, _, r, off, _ in catch]) if self.mtp else None
        x, logits = self.run(h, tokens, [(start, r, seq.blocks) for seq, start, r, _, _ in catch])
        picks = [i for i, entry in enumerate(catch) if entry[4]]
        if not picks:
            return
        seqs = [catch[i][0] for i in picks]
        # (indices sent in one copy without a wait: a pageable copy would wait for the steps queued)
        counts, picked = all_on_device([[r for _, _, r, _, _ in catch], picks], self.device)
        last = (counts.cumsum(0) - 1)[picked]
        x, logits = (x[last] if x is not None else None), logits[last]
        if self.shape is None:
            self.chain(seqs, x, logits, Reach.known(seqs, shift))
        else:
            self._draw(seqs, x, logits, shift)

    @staticmethod
    def _pick(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft for each row (on the device): the argmax for greedy requests, for sampled
        ones a draw from q, their distribution (also returned, [S, V] in row order, for the
        acceptance test)."""
        return sample_rows(logits, [seq.params for seq in seqs], [None] * len(seqs))

    def chain(self, seqs: list[Sequence], x: torch.Tensor | None, logits: torch.Tensor, reach: Reach) -> None:
        """Drafts chained on the device, when no processor shapes them: each draft is the
        next draft step's input where it lies, the host only growing the blocks; the drafts
        stay there for the verify step, with no wait for them (a sampled one's q too, for
        the acceptance test). `reach`: where each draft step of `seqs` is (`Reach`)."""
        fed = [list(range(len(seqs)))]  # fed[j]: the sequences draft j + 1 is theirs
        drafts, qs = [], []  # per draft: the tokens of fed[j]; the q rows of its sampled ones
        while True:
            token, q = self._pick(logits, [seqs[i] for i in fed[-1]])
            drafts.append(token)
            qs.append(q)
            if len(drafts) == self.k:
                break
            step = self._next([seqs[i] for i in fed[-1]], len(drafts) - 1, x, token, reach.of(fed[-1]))
            if step is None:
                break
            room, x, logits = step
            fed.append([fed[-1][n] for n in room])
        # Left on the device: the verify step reads them there (Engine.forward), judging
        # brings them to the host with its one copy (judge).
        flat, at = torch.cat(drafts), 0
        for who, q in zip(fed, qs):
            self._add([seqs[i] for i in who], [-1] * len(who), q)
            for i in who:
                seq = seqs[i]
                if seq.draft_at is None:  # (a sequence drafts only once its last drafts are judged)
                    seq.draft_at = (flat, [])
                seq.draft_at[1].append(at)
                at += 1

    def _draw(self, seqs: list[Sequence], x: torch.Tensor | None, logits: torch.Tensor, shift: int) -> None:
        """Drafts as the operator's processors shape them: one step at a time, each draft on
        the host before the next row is shaped (a processor sees the drafts before it as
        generated tokens)."""
        for j in range(self.k):
            try:
                with stage("speculative decoding"):
                    token, q = self._pick(self.shape(logits, seqs), seqs)
                    drafts = token.tolist()
            except SequenceFault:  # (a processor failed: their sampling meets it again)
                break
            if q is not None and bool(q.isnan().any()):  # (a sampled row left nothing to draw: the same)
                break
            self._add(seqs, drafts, q)
            if j == self.k - 1:
                break
            step = self._next(seqs, j, x, drafts, Reach.known(seqs, shift))
            if step is None:
                break
            room, x, logits = step
            seqs = [seqs[n] for n in room]

    def _next(self, seqs: list[Sequence], j: int, x: torch.Tensor | None, tokens: list[int] | torch.Tensor,
              reach: Reach):
        """The drafter on draft j of `seqs` (`tokens`, on the host or the device), where
        `reach` puts it (the MTP layer sits one position behind the token it predicts from,
        and chains on its own output, `x`), for those with a cache slot there: (their indices
        in `seqs`, hidden states, logits), or None if none has one."""
        at = [base + j + 1 for base in reach.bases]
        room = [n for n, (seq, pos, slack) in enumerate(zip(seqs, at, reach.slack)) if self.room(seq, pos + slack)]
        if not room:
            return None
        shift = reach.offsets
        if len(room) < len(seqs):  # (mostly every one has: nothing to pick)
            keep = on_device(room, self.device, torch.long)
            x = x[keep] if x is not None else None
            tokens = tokens[keep] if isinstance(tokens, torch.Tensor) else [tokens[n] for n in room]
            shift = shift[keep] if shift is not None else None
        return (room, *self.run(x, tokens, [(at[n], 1, seqs[n].blocks) for n in room], shift))

    @staticmethod
    def _add(seqs: list[Sequence], tokens: list[int], q: torch.Tensor | None) -> None:
        """One more draft for each of `seqs`: its token, and for a sampled one its row of q
        (the sampled rows' distributions, in order)."""
        rows = iter(q) if q is not None else None
        for seq, t in zip(seqs, tokens):
            seq.drafts.append(t)
            seq.draft_probs.append(None if seq.params.greedy else next(rows))

    def room(self, seq: Sequence, position: int) -> bool:
        """Whether `seq` has (or can get) a cache slot at `position`."""
        if self.blocks.can_grow(seq, position + 1):
            self.blocks.grow(seq, position + 1)
            return True
        return False
