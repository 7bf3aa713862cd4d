"""Drafted steps launched ahead (drafts_ahead.py): a verify step and the drafter's steps go
to the device before the step in flight has landed, their rows moved on by the drafts that
step keeps, known on the device only. What the host books, grows and lands must give
exactly what steps one at a time give. On the CPU, with the graphs stood in for
(tests/graphs_on_cpu.py): what runs is the host's side, as on a GPU. Off by default
(--drafts-ahead): these engines turn it on."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from draws import two_sample_p_value
from engine_steps import LOGPROBS, ending_in_turn, mixed_requests, run_to_end, speculating
from graphs_on_cpu import engine_with_graphs, stand_in_for_graphs

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine import drafts_ahead
from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.pipeline import StepPipeline
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.scheduler import Scheduler
from preload.worker.engine.sequence import Sequence

BASE = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False, max_num_seqs=6, drafts_ahead=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32", engine=BASE)


def counting(monkeypatch) -> list[int]:
    """Count the drafted steps launched while another flew (the list's one number)."""
    count, launch = [0], drafts_ahead.launch_drafted

    def counted(e, batch, before):
        count[0] += before is not None
        return launch(e, batch, before)

    monkeypatch.setattr("preload.worker.engine.pipeline.launch_drafted", counted)
    return count


def launched_ahead(engine, seqs: list[Sequence]) -> list:
    engine.pipeline = StepPipeline(engine)
    try:
        return list(run_to_end(engine, seqs).values())
    finally:
        engine.pipeline = None


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
@pytest.mark.parametrize("k", [1, 3])
def test_drafted_steps_launched_ahead_give_the_tokens_of_steps_one_at_a_time(llm, monkeypatch, method, k):
    """Greedy requests drafting k tokens a step, batches of 6 down to 1: launched while the
    step before flies, each step's rows where the drafts that step keeps put them; the same
    tokens as steps one at a time (and as decoding without drafts), the same drafts kept."""
    config = speculating(BASE, method, k)
    eager = LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine
    want = [o.token_ids for o in run_to_end(eager, ending_in_turn()).values()]
    stand_in_for_graphs(monkeypatch)
    count = counting(monkeypatch)
    engine = engine_with_graphs(llm, config)
    got = launched_ahead(engine, ending_in_turn())
    assert [o.token_ids for o in got] == want == [o.token_ids for o in run_to_end(llm.engine, ending_in_turn()).values()]
    s = engine.stats()
    assert count[0] >= 5 and s.decode_ahead_steps >= count[0], s
    assert engine.stats().spec_accepted_tokens == eager.stats().spec_accepted_tokens > 0
    assert engine.blocks.used == 0 and all(not seq.unsure for seq in engine.scheduler.running)


@pytest.mark.parametrize("method, cache, seed", [("mtp", "fp8", 3), ("draft_model", "auto", 0)])
def test_a_mixed_workload_launched_ahead_gives_what_steps_one_at_a_time_give(llm, monkeypatch, method, cache, seed):
    """engine_steps.mixed_requests with 2 drafts a step, 16 tokens a step through 5 places
    and 20 blocks of 4 (preemptions while a drafted step flies; prefix hits): batches go
    from launched ahead to run from the host and back (prompt chunks, the grammar request),
    drafting and non-drafting rows (seeded, penalized, log-probs) launched ahead together.
    The tokens, stops and log-probs of eager steps one at a time."""
    config = replace(speculating(BASE, method, 2), block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
                     enable_prefix_caching=True, kv_cache_dtype=cache)
    probe = LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine
    config = replace(config, kv_cache_memory=20 * (config.kv_cache_memory // (probe.blocks.num_blocks + 1)))
    eager = LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine
    want = list(run_to_end(eager, mixed_requests(seed)).values())
    stand_in_for_graphs(monkeypatch)
    count = counting(monkeypatch)
    engine = engine_with_graphs(llm, config)
    got = launched_ahead(engine, mixed_requests(seed))
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[LOGPROBS].logprobs == pytest.approx(want[LOGPROBS].logprobs, abs=1e-5)
    s = engine.stats()
    assert count[0] >= 10 and s.preemptions > 0 and s.prefix_hit_tokens > 0 and s.spec_accepted_tokens > 0
    assert engine.blocks.used == 0


def test_sampled_drafts_launched_ahead_keep_the_targets_distribution(llm, monkeypatch):
    """400 copies of one prompt sampled (temperature 1, top-k 4) with 2 MTP drafts a step,
    launched ahead: judged by rejection sampling on the device, the next step's rows where
    the draws put them; at each position the tokens are distributed as without drafts (a
    two-sample chi-square test at 1e-4)."""
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    stand_in_for_graphs(monkeypatch)
    count = counting(monkeypatch)
    engine = engine_with_graphs(llm, speculating(replace(BASE, max_num_seqs=64), "mtp", 2))
    drafted = launched_ahead(engine, [Sequence([5, 6, 7, 8], params) for _ in range(400)])
    plain = run_to_end(llm.engine, [Sequence([5, 6, 7, 8], params) for _ in range(400)]).values()
    for pos in (1, 2, 3):
        p = two_sample_p_value([o.token_ids[pos] for o in drafted], [o.token_ids[pos] for o in plain])
        assert p > 1e-4, (pos, p)
    s = engine.stats()
    assert count[0] > 0 and 0 < s.spec_accepted_tokens < s.spec_draft_tokens


def test_a_batch_scheduled_while_a_drafted_step_flies_has_blocks_for_every_draft_it_may_keep():
    """A sequence booked at 8 computed tokens with 3 drafts in flight (unsure) and 2 drafts of
    its own for the next step: that step's rows lie anywhere from position 8 to 11 + 2, so
    it is given blocks through 14 tokens (4 blocks of 4), not 11. Preempted meanwhile, it
    waits for the landing before it is admitted again: how many tokens it has is not known."""
    s = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence(list(range(1, 9)), SamplingParams(max_tokens=20))
    s.add(seq)
    [(_, n)] = s.schedule()
    seq.computed, seq.unsure = n, 3
    seq.output.append(-1)
    seq.drafts, seq.draft_probs = [5, 6], [None, None]
    [(_, n)] = s.schedule()
    assert n == 3 and len(seq.blocks) == 4  # (8 + 3 + 3 = 14 tokens)
    s._preempt(seq)
    assert s.schedule() == [] and s.waiting[0] is seq
    seq.unsure = 0  # (landed)
    assert s.schedule() and seq in s.running


def test_an_abort_while_its_drafted_step_flies_frees_everything(llm, monkeypatch):
    """The second request aborted once it has 3 tokens or more and a drafted step of its own
    flies (its drafts not judged yet): nothing more reaches it, the others get what they get alone, and
    every block comes back, the aborted one's after the steps in flight wrote them."""
    config = speculating(BASE, "mtp", 3)
    want = [o.token_ids for o in run_to_end(llm.engine, ending_in_turn()).values()]
    stand_in_for_graphs(monkeypatch)
    engine = engine_with_graphs(llm, config)
    engine.pipeline = StepPipeline(engine)
    seqs = ending_in_turn()

    def abort_second(outputs):
        flight = engine.pipeline.flight
        if sum(len(o.token_ids) for o in outputs[seqs[1].id]) >= 3 and not seqs[1].finished \
                and flight is not None and seqs[1] in flight.seqs and flight.ks[flight.seqs.index(seqs[1])]:
            engine.abort(seqs[1])

    got = run_to_end(engine, seqs, each_step=abort_second)
    aborted = got[seqs[1].id]
    assert aborted.finish_reason is None and aborted.token_ids == want[1][: len(aborted.token_ids)]
    assert len(aborted.token_ids) < len(want[1])
    assert [got[s.id].token_ids for i, s in enumerate(seqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert engine.blocks.used == 0 and not engine.has_work()


def test_without_drafts_ahead_drafted_steps_run_from_the_host(llm, monkeypatch):
    """--drafts-ahead is off by default (options.py says why): a drafted step is launched
    only once the step before has landed, and the tokens are the same."""
    stand_in_for_graphs(monkeypatch)
    count = counting(monkeypatch)
    engine = engine_with_graphs(llm, speculating(replace(BASE, drafts_ahead=False), "mtp", 2))
    got = launched_ahead(engine, ending_in_turn())
    assert [o.token_ids for o in got] == [o.token_ids for o in run_to_end(llm.engine, ending_in_turn()).values()]
    assert count[0] == 0 and engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_a_full_batch_of_drafting_sequences_is_launched_ahead(llm, monkeypatch, method):
    """As many sequences as places (6), each with its drafts: the drafter's graphs hold the
    catch-up (the MTP layer's k + 1 rows a sequence; a draft model's one more), so the steps
    are launched ahead at the full batch too."""
    stand_in_for_graphs(monkeypatch)
    count = counting(monkeypatch)
    engine = engine_with_graphs(llm, speculating(BASE, method, 1))
    seqs = [Sequence([5 + i, 6, 7, 8], SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(6)]
    got = launched_ahead(engine, seqs)
    want = run_to_end(llm.engine, [Sequence(s.prompt, s.params) for s in seqs]).values()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert count[0] >= 4
