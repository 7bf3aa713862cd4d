"""Steps launched one ahead (--async-scheduling, pipeline.py) change when the host learns
a step's tokens, never what they are: every request gets exactly what it gets with steps
run one at a time, whatever ends it (length, a stop token while the next step is in flight,
an abort), prompts chunked beside decode rows, preempted or found in the prefix cache, and
nothing it held is left behind.

On a GPU the engine makes its pipeline itself; here, on the CPU where it would not,
the tests give the engine one, so that its bookkeeping runs as it does there."""

from __future__ import annotations

import random

import pytest
import torch
from engine_steps import mixed_requests, run_to_end

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.output import Output
from preload.worker.engine.grammar import regex_grammar
from preload.worker.engine.pipeline import StepPipeline
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.model.kv_cache import bytes_per_token

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32")


@pytest.fixture
def engine(llm):
    """The module's engine, with or without a pipeline as each test sets it, empty after."""
    yield llm.engine
    llm.engine.pipeline = None
    assert not llm.engine.has_work() and llm.engine.blocks.used == 0  # every block given back


def run(engine, seqs: list[Sequence], pipelined: bool, each_step=None) -> dict[int, Output]:
    """Drive `engine` until `seqs` are done (with a pipeline or without); each one's merged Output."""
    engine.pipeline = StepPipeline(engine) if pipelined else None
    return run_to_end(engine, seqs, each_step)


def requests(**params) -> list[Sequence]:
    return [Sequence(p, SamplingParams(**({"max_tokens": 6 + 3 * i, "ignore_eos": True} | params)))
            for i, p in enumerate(PROMPTS)]


def same(engine, make, **kw) -> tuple[list[Output], list[Output]]:
    """The outputs of the sequences `make()` gives, one step at a time and pipelined."""
    alone = list(run(engine, make(), pipelined=False).values())
    ahead = list(run(engine, make(), pipelined=True, **kw).values())
    for a, b in zip(alone, ahead):
        assert (b.token_ids, b.text, b.finish_reason, b.error) == (a.token_ids, a.text, a.finish_reason, a.error)
    return alone, ahead


def count_launches_ahead(engine, monkeypatch) -> list[int]:
    """How many steps went to the model with their inputs on the device (launched ahead)."""
    ahead, forward = [], engine.forward
    monkeypatch.setattr(engine, "forward", lambda spans, rows, tokens=None: (
        ahead.append(len(spans)) if tokens is not None else None, forward(spans, rows, tokens))[1])
    return ahead


def test_greedy_outputs_are_the_same_and_steps_are_launched_ahead(engine, monkeypatch):
    launched = count_launches_ahead(engine, monkeypatch)
    alone, _ = same(engine, requests)
    assert [len(o.token_ids) for o in alone] == [6, 9, 12]
    assert launched and max(launched) == 3  # the whole batch, launched ahead


def test_requests_ending_by_length_leave_the_others_launched_ahead(engine, monkeypatch):
    """The three requests end at 6, 9 and 12 tokens: the steps after each end are still
    launched ahead, carrying the others (their draws picked on the device); from the first
    decode step on, every step is (the prompt step's draws fed to it on the device)."""
    from_host, forward = [], engine.forward
    monkeypatch.setattr(engine, "forward", lambda spans, rows, tokens=None: (
        from_host.append(len(spans)) if tokens is None and all(n == 1 for _, _, n in spans) else None,
        forward(spans, rows, tokens))[1])
    launched = count_launches_ahead(engine, monkeypatch)
    alone, _ = same(engine, requests)
    from_host.clear(), launched.clear()
    steps = dict(engine.clock.steps)
    run(engine, requests(), pipelined=True)
    assert from_host == []
    assert launched == [3] * 5 + [2] * 3 + [1] * 3  # (their 2nd to 6th, 7th to 9th, 10th to 12th tokens)
    # the engine's step clock (/metrics) saw the same: one prompt step, then a step landed
    # each time one launched ahead did
    assert {k: engine.clock.steps[k] - steps[k] for k in steps} == {"prompt": 1, "decode": 0, "decode_ahead": 11}


def test_seeded_sampling_and_logprobs_are_the_same(engine):
    alone, ahead = same(engine, lambda: requests(temperature=0.9, top_p=0.9, seed=7, logprobs=3))
    for a, b in zip(alone, ahead):
        assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs


def test_a_stop_token_while_the_next_step_is_in_flight(engine, monkeypatch):
    """The middle request stops on its 4th token: the step launched ahead for it is
    computed for nothing, and the others go on unchanged."""
    [first] = run(engine, [requests()[1]], pipelined=False).values()
    stop = first.token_ids[3]
    launched = count_launches_ahead(engine, monkeypatch)

    def make():
        seqs = requests()
        seqs[1].params = SamplingParams(max_tokens=9, stop_token_ids=[stop], ignore_eos=True)
        return seqs

    _, ahead = same(engine, make)
    assert ahead[1].finish_reason == "stop" and ahead[1].token_ids[-1] == stop
    assert len(ahead[1].token_ids) == first.token_ids.index(stop) + 1
    assert 3 in launched  # the step in flight when it stopped held all three


def test_an_abort_mid_run_frees_everything(engine):
    seqs = requests()

    def abort_second(outputs):
        if len(outputs[seqs[1].id]) == 3 and not seqs[1].finished:
            engine.abort(seqs[1])

    out = run(engine, seqs, pipelined=True, each_step=abort_second)
    assert out[seqs[1].id].finish_reason is None and len(out[seqs[1].id].token_ids) == 3  # nothing after the abort
    assert [len(out[s.id].token_ids) for s in (seqs[0], seqs[2])] == [6, 12]


@pytest.mark.parametrize("params", [{"presence_penalty": 1.5, "frequency_penalty": 2.0}, {"repetition_penalty": 2.0},
                                    {"frequency_penalty": 2.0, "temperature": 0.8, "seed": 5},
                                    {"min_tokens": 4, "logit_bias": ((7, 3.0),), "repetition_penalty": 1.5}],
                         ids=["penalties", "repetition", "sampled", "steered"])
def test_penalized_and_steered_requests_are_launched_ahead_and_draw_the_same(engine, monkeypatch, params):
    """Penalties count the token drawn in the step in flight, a placeholder on the host,
    from the device (sampler.py): the same tokens as one step at a time, each step after
    the first launched ahead. (Strong penalties: each draw changes what the next is.)"""
    launched = count_launches_ahead(engine, monkeypatch)
    alone, _ = same(engine, lambda: requests(**params))
    assert [len(o.token_ids) for o in alone] == [6, 9, 12]
    assert len(launched) == 11


def test_requests_with_a_grammar_are_launched_ahead_and_draw_late(engine, monkeypatch):
    """A grammar's matcher reads each token on the host before the next draw is masked: the
    step's forward is launched ahead all the same, its draws made once the step before has
    landed. Beside plain and penalized requests; one ends by its grammar (a stop while the
    next step is in flight), the others by length."""
    launched = count_launches_ahead(engine, monkeypatch)

    def make():
        seqs = requests(temperature=0.8, seed=11)
        seqs[0].params = SamplingParams(max_tokens=12, grammar=regex_grammar("(yes|no|maybe)"))
        seqs[1].params = SamplingParams(max_tokens=9, ignore_eos=True, grammar=regex_grammar("[a-z ]+"))
        seqs[2].params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.5)
        return seqs

    alone, _ = same(engine, make)
    assert alone[0].finish_reason == "stop" and alone[0].text in ("yes", "no", "maybe")
    assert set(alone[1].text) <= set("abcdefghijklmnopqrstuvwxyz ") and len(alone[1].token_ids) == 9
    assert len(launched) >= 10 and 3 in launched


class NoRepeat:
    """A logits processor that reads the outputs on the host: the token generated last is
    banned next (so that a draw made without the step before it landed would differ)."""

    def __init__(self, context):
        pass

    def __call__(self, logits, batch):
        for row, out in enumerate(batch.outputs):
            if out:
                logits[row, out[-1]] = float("-inf")
        return logits


def test_logits_processors_draw_late_with_every_token_before_theirs():
    engine = engine_with(kv_cache_memory=32 << 20, logits_processors=(f"{__name__}:NoRepeat",))
    launched, forward = [], engine.forward
    engine.forward = lambda spans, rows, tokens=None: (launched.append(tokens is not None), forward(spans, rows, tokens))[1]
    alone, ahead = same(engine, lambda: requests(repetition_penalty=0.5))  # (below 1: repeats made likelier)
    assert all(a != b for o in alone for a, b in zip(o.token_ids, o.token_ids[1:]))
    assert launched.count(True) >= 10


def test_an_arrival_is_admitted_at_the_next_step(engine):
    """A request that arrives while steps are launched ahead waits one step at most:
    the step in flight lands, and the next is scheduled with the newcomer."""
    first = requests()[2]
    late = Sequence([20, 21, 22], SamplingParams(max_tokens=4, ignore_eos=True))
    [alone] = run(engine, [Sequence(late.prompt, late.params)], pipelined=False).values()
    [before] = run(engine, [requests()[2]], pipelined=False).values()
    steps, first_token = [], []

    def arrive(outputs):
        steps.append(len(steps) + 1)
        if len(steps) == 3:  # (a step was launched ahead during this one)
            engine.check(late)
            engine.add(late)
            outputs[late.id] = []
        if outputs.get(late.id) and not first_token:
            first_token.append(len(steps))

    outputs = run(engine, [first], pipelined=True, each_step=arrive)
    assert first_token == [5]  # step 4 schedules it (its prompt launched ahead), step 5 lands its first token
    assert outputs[first.id].token_ids == before.token_ids
    assert late.finished and late.output == alone.token_ids


LONG = [list(range(5, 25)), [9, 10, 11], list(range(30, 43))]  # 20, 3 and 13 prompt tokens


def long_requests(**params) -> list[Sequence]:
    return [Sequence(p, SamplingParams(**({"max_tokens": 6 + 3 * i, "ignore_eos": True} | params)))
            for i, p in enumerate(LONG)]


def engine_with(**options):
    """A bundled-model engine of its own, with these EngineOptions."""
    return LLM(BUNDLED_MODEL, dtype="float32", engine=EngineOptions(**options)).engine


def test_prompts_chunked_beside_decode_rows_are_launched_ahead(monkeypatch):
    """8 tokens a step: the prompts go in chunks, beside the rows of those decoding already,
    whose inputs are the step in flight's draws, on the device."""
    engine = engine_with(max_num_batched_tokens=8)
    mixed, forward = [], engine.forward
    monkeypatch.setattr(engine, "forward", lambda spans, rows, tokens=None: (
        mixed.append(sorted(n for _, _, n in spans)) if tokens is not None and any(n > 1 for _, _, n in spans) else None,
        forward(spans, rows, tokens))[1])
    same(engine, long_requests)
    same(engine, lambda: long_requests(temperature=0.9, top_p=0.9, seed=3, logprobs=2))
    assert mixed and all(1 in ns for ns in mixed), mixed  # (chunks with decode rows fed from the device)


def test_preemption_while_a_step_is_in_flight_keeps_outputs():
    """12 blocks of 4 tokens hold one or two of the three at a time: the newest is
    preempted while the step that booked its last token is in flight, and recomputed."""
    cfg = LLM(BUNDLED_MODEL, dtype="float32").engine.model.cfg
    per_token = bytes_per_token(cfg, cfg.num_layers, torch.float32)
    engine = engine_with(kv_cache_memory=12 * 4 * per_token, block_size=4, max_num_batched_tokens=16)
    alone = run(engine, long_requests(), pipelined=False)
    before = engine.scheduler.preemptions
    ahead = run(engine, long_requests(), pipelined=True)
    assert engine.scheduler.preemptions > before
    for a, b in zip(alone.values(), ahead.values()):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert not engine.has_work() and engine.blocks.used == 0


def test_blocks_are_keyed_by_the_tokens_landed():
    """A prompt that is an earlier request's prompt and output finds every full block of
    it cached: the blocks holding output tokens were keyed by the tokens drawn, never by
    the placeholders booked while they were in flight."""
    for pipelined in (False, True):
        engine = engine_with(block_size=4)
        first = Sequence(list(range(5, 25)), SamplingParams(max_tokens=12, ignore_eos=True))
        [out] = run(engine, [first], pipelined).values()
        again = Sequence(first.prompt + out.token_ids, SamplingParams(max_tokens=4, ignore_eos=True))
        [second] = run(engine, [again], pipelined).values()
        assert second.cached_tokens == 28, (pipelined, second.cached_tokens)  # (20 + 11 computed: 7 full blocks)


def test_a_draw_that_fails_in_a_step_launched_ahead_ends_that_request_alone(engine, monkeypatch):
    """The victim's draw fails in every batch it is in, and alone: it ends with the stage
    named at the landing of that step; the step launched meanwhile computed its row for
    nothing; the request beside it gets what it gets alone."""
    from preload.worker.engine import flight as flight_module

    [alone] = run(engine, [requests()[2]], pipelined=False).values()
    victim, bystander = requests()[0], requests()[2]
    real = flight_module.sample_batch

    def sample_batch(logits, params, generators, generated, pending=None):
        if any(p is victim.params for p in params):
            raise RuntimeError("boom")
        return real(logits, params, generators, generated, pending)

    monkeypatch.setattr(flight_module, "sample_batch", sample_batch)
    out = run(engine, [victim, bystander], pipelined=True)
    assert out[victim.id].error == "sampling failed for this request: RuntimeError: boom"
    assert out[victim.id].token_ids == [] and victim.finished
    assert out[bystander.id].token_ids == alone.token_ids and out[bystander.id].error is None


def test_a_mixed_workload_gives_what_steps_one_at_a_time_give():
    """Fourteen requests of 2 to 40 prompt tokens and 1 to 14 output tokens through 6 places
    and 16 tokens a step: prompts chunked beside decode rows, admissions as places free up,
    greedy and seeded draws, stops on many tokens (some while a step is in flight), and
    requests with penalties (launched ahead too: sampler.py) among the others."""
    engine = engine_with(max_num_batched_tokens=16, max_num_seqs=6)

    def make() -> list[Sequence]:
        gen = random.Random(7)
        seqs = []
        for i in range(14):
            prompt = [gen.randrange(5, 200) for _ in range(gen.randrange(2, 41))]
            params = {"max_tokens": gen.randrange(1, 15), "ignore_eos": True}
            if i % 4 == 1:
                params |= {"temperature": 0.8, "seed": i, "logprobs": 2}
            if i % 5 == 2:
                params |= {"presence_penalty": 0.3}
            if i % 3 == 0:
                params |= {"stop_token_ids": list(range(3, 1000, 5))}
            seqs.append(Sequence(prompt, SamplingParams(**params)))
        return seqs

    alone, ahead = same(engine, make)
    for a, b in zip(alone, ahead):  # (batches made otherwise around a stop: float32 sums in another order)
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-5)
    assert any(o.finish_reason == "stop" for o in alone) and any(o.finish_reason == "length" for o in alone)


@pytest.mark.parametrize("seed", range(4))
def test_preemptions_and_shared_prefixes_under_load_give_what_steps_one_at_a_time_give(seed):
    """engine_steps.mixed_requests, whose prompts share prefixes of one another (the prefix
    cache finds them), through 20 blocks of 4 tokens (preemptions), 12 tokens a step and 5
    places: greedy and seeded, some stopping on many tokens, some penalized (their token in
    flight counted from the device), one under a grammar (drawn late): the same tokens, and
    every block given back."""
    cfg = LLM(BUNDLED_MODEL, dtype="float32").engine.model.cfg
    per_token = bytes_per_token(cfg, cfg.num_layers, torch.float32)
    engine = engine_with(kv_cache_memory=20 * 4 * per_token, block_size=4, max_num_batched_tokens=12, max_num_seqs=5)

    alone = run(engine, mixed_requests(seed), pipelined=False)
    ahead = run(engine, mixed_requests(seed), pipelined=True)
    for a, b in zip(alone.values(), ahead.values()):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert not engine.has_work() and engine.blocks.used == 0
    assert engine.scheduler.preemptions > 0 and any(o.cached_tokens for o in ahead.values())
