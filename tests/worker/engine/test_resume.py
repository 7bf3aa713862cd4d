"""A request resumed with the output it had so far (its engine died, and another takes it
up) goes on as if nothing happened: the same tokens, greedy or seeded, with penalties,
with a grammar, with log-probs, on an engine that drafts, its text the same piece by
piece; the draws of a seeded request are keyed by its seed and the position alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from engine_steps import run_to_end

from preload import BUNDLED_MODEL, LLM
from preload.worker.engine.grammar import json_schema_grammar
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText
from preload.worker.engine.sampling_params import RequestError, SamplingParams, draw_seed
from preload.worker.engine.sequence import Sequence

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32")


def whole(engine, params: SamplingParams) -> Output:
    [out] = run_to_end(engine, [Sequence(PROMPT, params)]).values()
    return out


def resumed_after(engine, params: SamplingParams, before: Output, k: int) -> Output:
    """The request taken up again with the first k tokens `before` gave it."""
    seq = Sequence(PROMPT, params, output=before.token_ids[:k])
    [out] = run_to_end(engine, [seq]).values()
    return out


CASES = {
    "greedy": SamplingParams(max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=24, temperature=0.8, seed=7, frequency_penalty=1.5, presence_penalty=0.5,
                                repetition_penalty=1.3, ignore_eos=True),
    "logprobs": SamplingParams(max_tokens=24, logprobs=3, ignore_eos=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k", [1, 9, 23])
def test_a_resumed_request_draws_what_it_would_have_drawn(llm, case, k):
    params = CASES[case]
    before = whole(llm.engine, params)
    after = resumed_after(llm.engine, params, before, k)
    assert before.token_ids[:k] + after.token_ids == before.token_ids
    assert after.finish_reason == before.finish_reason == "length"
    if params.logprobs is not None:
        assert after.logprobs == pytest.approx(before.logprobs[k:], abs=1e-4)
        assert [sorted(t) for t in after.top_logprobs] == [sorted(t) for t in before.top_logprobs[k:]]
    assert llm.engine.blocks.used == 0


@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_a_request_resumed_on_a_drafting_engine_draws_what_it_would_have_drawn(llm, case):
    """Taken up by an engine that drafts (the MTP layer, 2 drafts a step): the tokens of the
    uninterrupted request on an engine without drafts (a seeded request does not draft)."""
    params = CASES[case]
    before = whole(llm.engine, params)
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    drafting = LLM(BUNDLED_MODEL, dtype="float32", engine=replace(llm.engine.config, speculative_config=spec)).engine
    after = resumed_after(drafting, params, before, 9)
    assert before.token_ids[:9] + after.token_ids == before.token_ids
    assert (drafting.stats().spec_draft_tokens > 0) == (case == "greedy")  # (the seeded one drafts nothing)


def test_its_text_reads_on_where_it_stopped(llm):
    """The front keeps a request's OutputText across the engines: the pieces after a
    resumption, added to those before, make the uninterrupted text."""
    params = CASES["seeded"]
    before = whole(llm.engine, params)
    text = OutputText(llm.tokenizer, params)
    head = text.add(Output(0, before.token_ids[:9]))
    tail = text.add(resumed_after(llm.engine, params, before, 9))
    assert head.text + tail.text == before.text == llm.tokenizer.decode(before.token_ids)


def test_a_grammar_reads_the_output_so_far_and_holds_the_rest():
    llm = LLM(BUNDLED_MODEL, dtype="float32")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=json_schema_grammar(schema))
    before = whole(llm.engine, params)
    json.loads(before.text)
    for k in (1, len(before.token_ids) // 2):
        after = resumed_after(llm.engine, params, before, k)
        assert before.token_ids[:k] + after.token_ids == before.token_ids
    with pytest.raises(RequestError, match="grammar refuses"):
        llm.engine.add(Sequence(PROMPT, params, output=[llm.tokenizer.encode("]]]")[0]]))


def test_a_seeded_draw_is_keyed_by_seed_and_position():
    seeds = {draw_seed(s, i) for s in (0, 1, 2**63) for i in range(50)}
    assert len(seeds) == 150 and all(0 <= x < 2**64 for x in seeds)
    params = replace(CASES["seeded"], seed=99)
    seq = Sequence(PROMPT, params)
    seq.generator = torch.Generator()
    a = seq.generator_at(4).initial_seed()
    seq.generator_at(5)
    assert seq.generator_at(4).initial_seed() == a == draw_seed(99, 4)
