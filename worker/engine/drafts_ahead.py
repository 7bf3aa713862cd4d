"""Drafted steps launched ahead (--async-scheduling with --speculative-config): a verify step
and the drafter's steps after it go to the GPU before the step in flight has landed, as
plain decode steps do (pipeline.py), so that the host's work between steps (the landing,
the schedule, the next step's buffers) overlaps the GPU's.

What a drafted step computes depends on the step before it through one number per
sequence known on the device only: how many of its drafts that step keeps, a. Its rows lie
at the host's positions moved on by a (cuda_graphs.DecodeGraphs.shift_rows: positions,
context lengths and cache slots set again on the device from the block tables, which the
scheduler grows for every draft that may be kept: Sequence.unsure); its inputs are the
token that step judged last and the drafts its drafter left on the device. So the host
books a drafted step as though it kept no draft: each sequence's `computed` moved on by
its pending token, one placeholder in its output, its drafts counted `unsure`; the landing
puts the kept drafts in before the placeholder and the judged token in it, and moves
`computed` on by a.

The drafter's catch-up has a fixed shape: the MTP layer reads the verify step's k + 1 rows
(at position i the token at i + 1: the next draft, or at the last kept position the
judged token, scattered in on the device); a draft model reads the k + 1 tokens fed and,
if it drafts next, one row more for the judged token (scattered into the row after the
kept drafts). Rows past the kept ones write the drafter's cache at positions past those
kept, as rejected drafts write the target's: harmless, since a position is read only by
rows at or after it, and each of those steps writes the position first. Its chained drafts
then lie past the host's positions by the drafts kept in flight and in this step
(speculative.Reach).

What still runs from the host, one step at a time: steps with prompt tokens, grammars
and the operator's logits processors (they read the drafts on the host), prompts being
scored, batches or contexts past the graphs.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from preload.worker.engine.faults import SequenceFault, stage
from preload.worker.engine.flight import PLACEHOLDER, Flight, draw, drawn_before, spans_of
from preload.worker.engine.host_logprobs import pack, unpack
from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence, Status
from preload.worker.engine.speculative import Drafter, Reach, fed_tokens, judged_on_device, speculates
from preload.worker.model.host_values import all_on_device, on_device

if TYPE_CHECKING:  # (the engine makes its pipeline)
    from preload.worker.engine.engine import Engine


def launches_drafted(e: Engine, batch: list[tuple[Sequence, int]]) -> bool:
    """Whether `batch`, on an engine with a drafter, may be launched before the step in
    flight lands: decode and verify rows alone, nothing read on the host mid-step, and
    every row, the drafter's too, in the graphs however many drafts are kept."""
    d = e.drafter
    if not batch or not e.config.drafts_ahead or e.processors or e.graphs is None or d.graphs is None:
        return False
    if any(n != 1 + len(seq.drafts) or seq.pending != 1 or seq.matcher is not None or seq.wants_prompt_logprobs
           for seq, n in batch):
        return False
    rows, tables = sum(n for _, n in batch), [seq.blocks for seq, _ in batch]
    farthest = max(seq.computed + seq.unsure + n for seq, n in batch) + d.k + 1  # (a chained draft's slot, at most)
    width = min(e.graphs.width, d.graphs.width) * e.blocks.block_size
    catch_up_rows = rows + (0 if d.mtp else len(batch))  # (a draft model reads the judged token in a row more)
    return e.graphs.holds(rows, tables) and d.graphs.holds(catch_up_rows, tables) and farthest <= width


def launch_drafted(e: Engine, batch: list[tuple[Sequence, int]], before: Flight | None) -> Flight:
    """Compute `batch` (its rows moved on by what `before` keeps, its inputs where `before`
    left them), judge its drafts and draw the others' tokens on the device, run the drafter
    for the next step's drafts, queue what the host needs in one copy, and book the step."""
    spans = spans_of(batch)
    seqs, ks = [seq for seq, _, _ in spans], [n - 1 for _, _, n in spans]
    dev, rows = e.device, sum(n for _, _, n in spans)
    firsts = list(accumulate((n for _, _, n in spans[:-1]), initial=0))
    plain, judged = [i for i, k in enumerate(ks) if not k], [i for i, k in enumerate(ks) if k]
    kept_rows = before.rows if before is not None and before.kept is not None else {}
    fed_after = [i for i, seq in enumerate(seqs) if before is not None and id(seq) in before.rows]
    # (every index the step's own operations take, in one copy)
    row_span, before_at, fed_at, fed_from, plain_at, plain_rows, judged_at, judged_rows = all_on_device([
        [i for i, (_, _, n) in enumerate(spans) for _ in range(n)],  # each row's span
        [kept_rows.get(id(seq), len(before.seqs)) for seq in seqs] if kept_rows else [],  # (past the end: a 0)
        [firsts[i] for i in fed_after], [before.rows[id(seqs[i])] for i in fed_after],
        plain, [firsts[i] for i in plain], judged, rows_of(judged, ks, firsts)], dev)
    # How far each sequence lies past the host's positions: the drafts `before` keeps of it.
    offsets = torch.cat([before.kept, before.kept.new_zeros(1)])[before_at] if kept_rows else \
        torch.zeros(len(seqs), dtype=torch.long, device=dev)
    fed = fed_tokens(spans, dev)  # (each pending token that `before` drew or judged last: from there)
    if len(fed_at):
        fed.index_copy_(0, fed_at, before.tokens[fed_from])
    logprobs, hidden = e.forward(spans, list(range(rows)), fed, shift=offsets[row_span])
    flight = Flight(spans, seqs, marks=[len(seq.output) for seq in seqs], ks=ks)
    flight.tokens = torch.zeros(len(seqs), dtype=torch.long, device=dev)  # each one's token fed next
    flight.kept = torch.zeros(len(seqs), dtype=torch.long, device=dev)
    parts = []
    if plain:
        own = [seqs[i] for i in plain]
        picked = logprobs[plain_rows]
        tokens, flight.faults = draw(e, own, picked, [seq.output for seq in own], drawn_before(own, before))
        packed, flight.n_top = pack(own, picked, tokens)
        flight.tokens.index_copy_(0, plain_at, tokens)
        parts.append(packed.flatten())
    if judged:
        parts += judge_ahead(flight, judged, logprobs, firsts, judged_at, judged_rows)
    slack = [seq.unsure for seq in seqs]  # (the most `offsets` can be)
    for seq, start, n in spans:  # booked as though no draft were kept: the landing adds those that are
        seq.computed, seq.unsure = start + 1, seq.unsure + n - 1
        seq.output.append(PLACEHOLDER)
        seq.keep_drafts(0)
    catch_up(e.drafter, spans, fed, hidden, flight, offsets, slack)
    flight.send(torch.cat(parts))
    return flight


def judge_ahead(flight: Flight, judged: list[int], logprobs: torch.Tensor, firsts: list[int],
                judged_at: torch.Tensor, judged_rows: torch.Tensor) -> list[torch.Tensor]:
    """Judge the drafts of `flight`'s sequences at `judged` (on the device: `judged_at`, their
    rows `judged_rows`): each one's kept count and last token into the flight; what the host
    needs of them (the counts, the last tokens, every draft) returned for the copy. If judging
    them together fails, each is judged alone, so that a failure is the one sequence's (it
    ends at the landing)."""
    dev, seqs, ks = logprobs.device, flight.seqs, flight.ks
    try:
        with stage("speculative decoding"):
            results = [judged_on_device(logprobs[judged_rows], [seqs[i] for i in judged])]
    except SequenceFault:
        results = []
        for i in judged:
            try:
                with stage("speculative decoding"):
                    results.append(judged_on_device(logprobs[on_device(rows_of([i], ks, firsts), dev, torch.long)],
                                                    [seqs[i]]))
            except SequenceFault as fault:
                flight.faults[seqs[i]] = fault
                results.append(tuple(torch.zeros(size, dtype=torch.long, device=dev) for size in (1, 1, ks[i])))
    n, last, d = (torch.cat(parts) for parts in zip(*results))
    flight.kept.index_copy_(0, judged_at, n)
    flight.tokens.index_copy_(0, judged_at, last)
    return [torch.cat([n, last, d]).double()]


def rows_of(picked: list[int], ks: list[int], firsts: list[int]) -> list[int]:
    """The rows (pending token and drafts) of the spans at `picked`, in order."""
    return [firsts[i] + j for i in picked for j in range(ks[i] + 1)]


def catch_up(d: Drafter, spans: list[tuple[Sequence, int, int]], fed: torch.Tensor, hidden: torch.Tensor,
             flight: Flight, offsets: torch.Tensor, slack: list[int]) -> None:
    """The drafter after a drafted step launched ahead: it catches up on every sequence's
    rows (a fixed shape, the step's kept drafts scattered in on the device) and drafts for
    those that speculate, chained where the step's kept drafts put them. `slack`: how far
    past the host's positions the step's rows may lie."""
    dev, mtp = d.device, d.mtp
    nexts, runs = [], []  # the spans drafting next; (start, rows, blocks) the drafter reads
    for i, (seq, start, n) in enumerate(spans):
        # (a draft model reads the judged token too, one row past the drafts, if it drafts next)
        drafts = speculates(seq) and (mtp or d.room(seq, start + n + slack[i]))
        if drafts:
            nexts.append(i)
        runs.append((start, n + (drafts and not mtp), seq.blocks))
    starts = list(accumulate((r for _, r, _ in runs[:-1]), initial=0))  # each span's first row
    firsts, picked, into, run_span = all_on_device([
        starts, nexts, [] if mtp else [first + j for first, (_, _, n) in zip(starts, spans) for j in range(n)],
        [i for i, (_, r, _) in enumerate(runs) for _ in range(r)]], dev)
    if mtp:  # (at position i, the token at i + 1: the next one fed, or after the last kept, the judged one)
        at = firsts + flight.kept
        tokens = fed.roll(-1).index_copy_(0, at, flight.tokens)
    else:  # (the tokens fed, and for those drafting next the judged one in the row after the kept drafts)
        at = firsts + flight.kept + 1
        tokens = torch.zeros(sum(r for _, r, _ in runs), dtype=torch.long, device=dev)
        tokens.index_copy_(0, into, fed)
        if nexts:
            tokens.index_copy_(0, at[picked], flight.tokens[picked])
    x, logits = d.run(hidden if mtp else None, tokens, runs, offsets[run_span])
    if not nexts:
        return
    rows = at[picked]
    seqs = [spans[i][0] for i in nexts]
    reach = Reach([spans[i][1] + 1 - mtp for i in nexts], [slack[i] + flight.ks[i] for i in nexts],
                  (offsets + flight.kept)[picked])
    d.chain(seqs, x[rows] if x is not None else None, logits[rows], reach)


def land_drafted(e: Engine, flight: Flight, later: Flight | None) -> list[Output]:
    """Take `flight`'s judged and drawn tokens on the host: kept drafts put in before each
    placeholder, the last token in it, `computed` moved on by the drafts kept (and the marks
    of `later`, launched meanwhile, with it); key the blocks it filled."""
    values, ks, seqs = flight.landed(e.clock), flight.ks, flight.seqs
    plain = [i for i, k in enumerate(ks) if not k]
    judged = [i for i, k in enumerate(ks) if k]
    width = 2 + 2 * flight.n_top
    got = dict(zip(plain, unpack([seqs[i] for i in plain],
                                 [values[r * width : (r + 1) * width] for r in range(len(plain))], flight.n_top)))
    at, m = len(plain) * width, len(judged)
    counts, lasts, drafts = values[at : at + m], values[at + m : at + 2 * m], values[at + 2 * m :]
    first = 0  # (each one's drafts in `drafts`)
    for i, a, last in zip(judged, counts, lasts):
        got[i] = ([int(t) for t in drafts[first : first + int(a)]] + [int(last)], None, None)
        first += ks[i]
    marks = later.rows if later is not None else {}
    outputs = []
    for i, (seq, start, _) in enumerate(flight.spans):
        seq.unsure -= ks[i]
        if seq.finished:
            continue
        token, logprob, top = got[i]
        emitted = token if isinstance(token, list) else [token]
        kept, mark = len(emitted) - 1, flight.marks[i]
        seq.output[mark:mark] = emitted[:-1]  # (before its placeholder, and any a later step booked)
        if kept and id(seq) in marks:
            later.marks[marks[id(seq)]] += kept
        # (else preempted since: it computes all again; or, having had no draft in flight,
        # admitted again in the same schedule, with fewer tokens computed)
        if seq.status is Status.RUNNING and seq.computed >= start + 1:
            seq.computed += kept
            e.blocks.cache_full_blocks(seq, upto=start + 1 + kept)
        if ks[i] and seq not in flight.faults:
            e.drafter.drafted += ks[i]
            e.drafter.accepted += kept
        outs = []
        try:
            if seq in flight.faults:
                raise flight.faults[seq]
            for j, t in enumerate(emitted):
                outs.append(e.took(seq, mark + j, t, logprob, top))
                if seq.finished:
                    break
        except SequenceFault as fault:
            outs.append(e.failed(seq, fault))
        outputs.append(Output.merge(outs))
    return outputs
