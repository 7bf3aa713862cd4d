"""Automatic prefix caching: full KV blocks shared between sequences that begin with the
same tokens from the same source (weights, cache_salt, adapter), reference-counted,
evicted least recently used; what a request gets is what it gets without the cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.block_manager import block_key
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import CacheSource, Sequence
from preload.worker.model.kv_cache import bytes_per_token

BLOCK = 16
SYSTEM = list(range(100, 100 + 5 * BLOCK))  # a shared "system prompt" of five full blocks


def engine_options(**kw) -> EngineOptions:
    return replace(EngineOptions(kv_cache_memory=64 << 20, block_size=BLOCK), **kw)


@pytest.fixture(scope="module")
def cached():
    return LLM(BUNDLED_MODEL, dtype="float32", engine=engine_options())


@pytest.fixture(scope="module")
def uncached():
    return LLM(BUNDLED_MODEL, dtype="float32", engine=engine_options(enable_prefix_caching=False))


def hits(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats()
    return s.prefix_queried_tokens, s.prefix_hit_tokens


def test_keys_keep_the_source_fields_apart():
    """Run together as strings, these sources would read alike; as keys they never match."""
    tokens = [1, 2, 3]
    pairs = [
        (CacheSource("f", "ab", "c"), CacheSource("f", "a", "bc")),  # the LoRA-name / cache_salt confusion
        (CacheSource("fa", None), CacheSource("f", "a")),
        (CacheSource("f", None, "x"), CacheSource("f", "x", None)),
        (CacheSource("f", ""), CacheSource("f", None)),
    ]
    for a, b in pairs:
        assert block_key(a, None, tokens) != block_key(b, None, tokens), (a, b)
    src = CacheSource("f")
    assert block_key(src, None, [1, 23]) != block_key(src, None, [12, 3])
    parent = block_key(src, None, tokens)
    assert block_key(src, parent, tokens) != block_key(src, None, tokens)  # a key names the whole prefix
    assert block_key(src, parent, tokens) == block_key(CacheSource("f"), parent, list(tokens))


def test_a_repeated_prompt_hits_and_gets_what_it_got_the_first_time(cached, uncached):
    prompt = SYSTEM + [5, 6, 7]
    before = hits(cached)
    first = cached.generate([prompt], max_tokens=12, logprobs=True, ignore_eos=True)[0]
    again = cached.generate([prompt], max_tokens=12, logprobs=True, ignore_eos=True)[0]
    plain = uncached.generate([prompt], max_tokens=12, logprobs=True, ignore_eos=True)[0]
    queried, hit = (now - was for now, was in zip(hits(cached), before))
    assert hit == len(SYSTEM)  # the second request found the five full blocks
    assert queried == 2 * len(prompt)
    assert first.token_ids == again.token_ids == plain.token_ids
    assert again.logprobs == pytest.approx(plain.logprobs, abs=1e-4)


def test_many_requests_sharing_a_system_prompt_equal_the_uncached_engine(cached, uncached):
    prompts = [SYSTEM + [7 + i, 300 + i, 40 + 2 * i] for i in range(6)] + [SYSTEM[: 2 * BLOCK] + [9, 9]]
    got = cached.generate(prompts, max_tokens=10, logprobs=True, ignore_eos=True)
    want = uncached.generate(prompts, max_tokens=10, logprobs=True, ignore_eos=True)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert cached.engine.stats().kv_blocks_used == 0  # every reference returned


def test_cache_salt_separates_requests(cached):
    prompt = [11] * (4 * BLOCK) + [3]
    before = hits(cached)[1]
    cached.generate([prompt], max_tokens=2, cache_salt="tenant-a")
    cached.generate([prompt], max_tokens=2, cache_salt="tenant-b")  # same tokens, another salt: no hit
    assert hits(cached)[1] == before
    cached.generate([prompt], max_tokens=2, cache_salt="tenant-a")
    assert hits(cached)[1] == before + 4 * BLOCK
    cached.generate([prompt], max_tokens=2)  # no salt is a source of its own too
    assert hits(cached)[1] == before + 4 * BLOCK


def test_output_tokens_are_cached_for_the_next_turn(cached):
    """A chat's next turn sends the last answer back in its prompt: those blocks hit too."""
    turn1 = [21 + (i % 50) for i in range(2 * BLOCK)]
    answer = cached.generate([turn1], max_tokens=3 * BLOCK, ignore_eos=True)[0].token_ids
    before = hits(cached)[1]
    cached.generate([turn1 + answer + [5, 5]], max_tokens=2)
    assert hits(cached)[1] - before >= 4 * BLOCK  # both prompt blocks and most of the answer's


def run_to_end(llm: LLM, seqs: list[Sequence]) -> None:
    for seq in seqs:
        llm.engine.check(seq)
        llm.engine.add(seq)
    while llm.engine.has_work():
        llm.engine.step()


def test_shared_blocks_are_counted_and_an_abort_returns_only_its_own():
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=engine_options())
    engine, blocks = llm.engine, llm.engine.blocks
    run_to_end(llm, [Sequence(SYSTEM + [1], SamplingParams(max_tokens=1))])  # caches SYSTEM's blocks
    a = Sequence(SYSTEM + [2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = Sequence(SYSTEM + [4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    for seq in (a, b):
        engine.check(seq)
        engine.add(seq)
    engine.step()
    shared = a.blocks[:5]
    assert shared == b.blocks[:5] and all(blocks.refs[x] == 2 for x in shared)
    engine.abort(a)
    assert all(blocks.refs[x] == 1 for x in shared) and a.blocks == []
    while engine.has_work():
        engine.step()
    assert all(blocks.refs[x] == 0 for x in shared) and all(x in blocks.evictable for x in shared)
    assert engine.stats().kv_blocks_used == 0


def test_a_full_cache_evicts_the_least_recently_used_blocks_and_preempts_correctly(uncached):
    """A cache of a few dozen blocks, prompts that do not fit together: cached blocks are
    evicted (oldest first) and sequences preempted, and every answer is the uncached one."""
    cfg = uncached.config
    per_block = BLOCK * bytes_per_token(cfg, cfg.num_layers, torch.float32)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=engine_options(kv_cache_memory=40 * per_block))
    blocks = llm.engine.blocks
    assert blocks.num_blocks == 40
    prompts = [SYSTEM + [50 + i] * (2 * BLOCK) for i in range(8)]
    got = llm.generate(prompts, max_tokens=2 * BLOCK, ignore_eos=True)
    want = uncached.generate(prompts, max_tokens=2 * BLOCK, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.engine.stats().preemptions > 0  # the cache was too small for all at once
    assert blocks.used == 0 and len(blocks.by_key) == len(blocks.key_of) <= blocks.num_blocks
    assert set(blocks.by_key.values()) == set(blocks.key_of)
