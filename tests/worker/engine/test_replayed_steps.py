"""Steps replayed from the decode graphs (cuda_graphs.py) and the prompt steps' pieces
(prompt_graphs.py) give what eager steps give: decode steps of batches across the buckets
(padding rows on the scratch block), prompts chunked beside decode rows, steps launched
ahead (their inputs on the device), verify steps and the drafter's steps of the
MTP layer and of a draft model. On the CPU, with the graphs stood in for
(tests/graphs_on_cpu.py): what runs is the graphs' host side, as on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_steps import LOGPROBS, ending_in_turn, mixed_requests, run_to_end, speculating
from graphs_on_cpu import engine_with_graphs, stand_in_for_graphs

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.pipeline import StepPipeline

BASE = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False, max_num_seqs=6)
BAN = 'preload.worker.engine.logits_processors:BanTokens={"token_ids": [13, 269, 290]}'


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32", engine=BASE)


def outputs(engine, pipelined: bool = False, **params) -> list:
    """Each request's tokens (with `params`: its Output)."""
    engine.pipeline = StepPipeline(engine) if pipelined else None
    try:
        got = run_to_end(engine, ending_in_turn(**params)).values()
        return list(got) if params else [o.token_ids for o in got]
    finally:
        engine.pipeline = None


@pytest.mark.parametrize("cache", ["auto", "fp8"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["one-at-a-time", "launched-ahead"])
def test_decode_and_prompt_steps_replayed_give_the_tokens_of_eager_steps(llm, monkeypatch, pipelined, cache):
    """16 tokens a step: the prompts go in chunks beside the decode rows of those admitted
    first, a prompt step's pieces between attentions replayed (prompt_graphs.py); then
    decode steps of 6 rows down to 1. The same tokens and log-probs (within float32's
    rounding: a decode row is computed apart in a graph), with the model's dtype in the
    cache and with fp8 (and its scales)."""
    config = replace(BASE, max_num_batched_tokens=16, kv_cache_dtype=cache)
    want = outputs(LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine, logprobs=0)
    graphs = stand_in_for_graphs(monkeypatch)
    engine = engine_with_graphs(llm, config)
    got = outputs(engine, pipelined, logprobs=0)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert sorted(engine.graphs.graphs) == [1, 2, 4, 6] and sorted(engine.prompt_graphs.graphs) == [16]
    assert all(g.replays > 0 for g in graphs)  # (every decode bucket and prompt piece replayed)
    assert engine.blocks.used == 0


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_and_draft_steps_replayed_give_the_tokens_of_eager_steps(llm, monkeypatch, method, k):
    eager = LLM(BUNDLED_MODEL, dtype="float32", engine=speculating(BASE, method, k)).engine
    want = outputs(eager)
    graphs = stand_in_for_graphs(monkeypatch)
    engine = engine_with_graphs(llm, speculating(BASE, method, k))
    assert outputs(engine) == want == outputs(llm.engine)
    verify = len(engine.graphs.graphs)  # (captured first: the target's, then the drafter's)
    assert any(g.replays for g in graphs[:verify]) and any(g.replays for g in graphs[verify:])
    assert engine.stats().spec_accepted_tokens == eager.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("method, processors", [(None, ()), ("mtp", ()), ("draft_model", ()), ("mtp", (BAN,))],
                         ids=["no-drafts", "mtp", "draft-model", "mtp-processor"])
def test_a_mixed_workload_replayed_and_launched_ahead_gives_what_eager_steps_give(llm, monkeypatch, method, processors):
    """engine_steps.mixed_requests (some sharing prefixes: prefix-cache hits; one under a
    grammar: drawn late) through 5 places, 16 tokens a step and 24 blocks of 4
    (preemptions), replayed from the graphs and launched ahead, against eager steps one at
    a time; without drafts, with them, and with them and the operator's logits processor
    (each draft drawn on the host)."""
    config = replace(speculating(BASE, method, 2) if method else BASE, block_size=4, max_num_batched_tokens=16,
                     max_num_seqs=5, enable_prefix_caching=True, logits_processors=processors)
    probe = LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine
    config = replace(config, kv_cache_memory=25 * (config.kv_cache_memory // (probe.blocks.num_blocks + 1)))
    eager = LLM(BUNDLED_MODEL, dtype="float32", engine=config).engine
    assert 22 <= eager.blocks.num_blocks <= 25
    want = list(run_to_end(eager, mixed_requests(3)).values())
    stand_in_for_graphs(monkeypatch)
    engine = engine_with_graphs(llm, config)
    engine.pipeline = StepPipeline(engine)
    got = list(run_to_end(engine, mixed_requests(3)).values())
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[LOGPROBS].logprobs == pytest.approx(want[LOGPROBS].logprobs, abs=1e-5)
    s = engine.stats()
    assert s.preemptions > 0 and s.prefix_hit_tokens > 0 and engine.blocks.used == 0
    if processors:
        assert not {13, 269, 290} & {t for o in got for t in o.token_ids}
