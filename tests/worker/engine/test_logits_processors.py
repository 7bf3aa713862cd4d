"""Logits processors: the operator's code, named at start (never by a request), applied to
every sequence's logits in the batch before sampling; the log-probs reported stay the
model's; a processor that fails fails the requests of that step, not the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions

BAN = "preload.worker.engine.logits_processors:BanTokens"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 100, 7]]


class Boom:
    def __init__(self, context):
        pass

    def __call__(self, logits, batch):
        raise ValueError("boom")


class WrongShape:
    def __init__(self, context):
        pass

    def __call__(self, logits, batch):
        return logits[:, :10]


def llm_with(*specs: str) -> LLM:
    return LLM(BUNDLED_MODEL, dtype="float32", engine=replace(EngineOptions(kv_cache_memory=32 << 20),
                                                              logits_processors=specs))


@pytest.fixture(scope="module")
def plain():
    return llm_with()


def test_banned_tokens_are_never_sampled_and_the_rest_is_unchanged(plain):
    want = plain.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    banned = sorted({t for w in want for t in w.token_ids[:3]})  # tokens the model does pick
    llm = llm_with(f'{BAN}={{"token_ids": {banned}}}')
    got = llm.generate(PROMPTS, max_tokens=12, ignore_eos=True, logprobs=True)
    for g, w in zip(got, want):
        assert not set(g.token_ids) & set(banned)
        assert g.token_ids != w.token_ids
        assert all(lp < 0 for lp in g.logprobs)  # the model's log-probs of what was drawn, finite


def test_processors_are_applied_in_the_order_given_and_with_sampling(plain):
    llm = llm_with(f'{BAN}={{"token_ids": [1, 2]}}', f'{BAN}={{"token_ids": [3]}}')
    out = llm.generate(PROMPTS, max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    assert all(not {1, 2, 3} & set(o.token_ids) for o in out)


@pytest.mark.parametrize("spec, says", [
    ("no_such_module_xyz:Thing", "ModuleNotFoundError"),
    ("preload.worker.engine.logits_processors:Nope", "has no attribute 'Nope'"),
    ("preload.worker.engine.logits_processors", "expected module:Class"),
    (f"{BAN}=[1, 2]", "expected module:Class or module:Class={json object}"),
    (f"{BAN}={{\"token_ids\": [-1]}}", "token_ids must be ids below"),
    (f"{BAN}=not json", "JSONDecodeError"),
])
def test_a_bad_processor_spec_is_refused_at_start_naming_it(spec, says):
    with pytest.raises(ValueError) as e:
        llm_with(spec)
    assert spec in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("name", ["Boom", "WrongShape"])
def test_a_failing_processor_fails_the_requests_not_the_engine(name):
    llm = llm_with(f"{__name__}:{name}")
    with pytest.raises(RuntimeError, match="logits processors failed"):
        llm.generate(PROMPTS[:1], max_tokens=2)
    assert not llm.engine.has_work() and llm.engine.stats().kv_blocks_used == 0
