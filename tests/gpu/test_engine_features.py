"""The engine's features on the GPU (bf16, Triton kernels): speculative decoding with
the MTP drafter and prefix-cache hits give the greedy tokens of plain decoding (up to
near ties: a verify pass of several tokens and a prefill over cached blocks sum in
another order than one-token steps), so do steps that mix decode rows with prompt
chunks, and a cache too small for everyone, with drafts on, preempts and finishes.

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

from dataclasses import replace

import pytest
from greedy import ONE_ULP, assert_same_greedy

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions

pytestmark = pytest.mark.gpu

EAGER = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False, enforce_eager=True)
SYSTEM = list(range(300, 300 + 80))  # five full blocks of 16 shared by every prompt
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], list(range(100, 140)), [9] * 20, SYSTEM + [11, 12], SYSTEM + [13]]


def mtp(k: int, **kw) -> EngineOptions:
    return replace(EAGER, speculative_config=f'{{"method": "mtp", "num_speculative_tokens": {k}}}', **kw)


@pytest.fixture(scope="module")
def plain():
    return LLM(BUNDLED_MODEL, device="cuda", engine=EAGER)


@pytest.fixture(scope="module")
def want(plain):
    return plain.generate(PROMPTS, max_tokens=32, logprobs=5, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_gives_the_greedy_tokens_of_plain_decoding(want, k):
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=mtp(k))
    assert_same_greedy(llm.generate(PROMPTS, max_tokens=32, ignore_eos=True), want, ONE_ULP)
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens <= s.spec_draft_tokens and s.kv_blocks_used == 0


@pytest.mark.parametrize("options", [replace(EAGER, enable_prefix_caching=True),
                                     replace(EAGER, enable_prefix_caching=True, enforce_eager=False),
                                     mtp(2, enable_prefix_caching=True)], ids=["eager", "graphs", "mtp"])
def test_prefix_hits_give_the_greedy_tokens_of_no_cache(want, options):
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=options)
    first = llm.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    queried, hit = llm.engine.stats().prefix_queried_tokens, llm.engine.stats().prefix_hit_tokens
    again = llm.generate(PROMPTS, max_tokens=32, ignore_eos=True)  # every full prompt block is cached now
    s = llm.engine.stats()
    assert s.prefix_hit_tokens - hit >= 5 * 16 * 2 and s.prefix_queried_tokens > queried
    assert_same_greedy(first, want, ONE_ULP)
    assert_same_greedy(again, want, ONE_ULP)


def test_a_full_cache_with_drafts_preempts_and_finishes(plain):
    """Eight sequences of 60 tokens wanting 100 more, three drafts a step, 40 blocks."""
    from preload.worker.model.kv_cache import bytes_per_token

    per_block = 16 * bytes_per_token(plain.config, plain.config.num_layers + 1, plain.dtype)
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=mtp(3, kv_cache_memory=40 * per_block, max_num_seqs=8))
    assert llm.engine.blocks.num_blocks == 40
    prompts = [[10 + i] * 60 for i in range(8)]
    got = llm.generate(prompts, max_tokens=100, ignore_eos=True)
    # (every divergence must still be a near tie at its first difference)
    assert_same_greedy(got, plain.generate(prompts, max_tokens=100, logprobs=5, ignore_eos=True), ONE_ULP, most=False)
    s = llm.engine.stats()
    assert s.preemptions > 0 and s.kv_blocks_used == 0 and not llm.engine.has_work()


def test_mixed_steps_give_the_greedy_tokens_of_steps_of_one_kind(want):
    """A budget of 24 tokens a step chunks the prompts, so that sequences already decoding
    share steps with the chunks of the others: their rows attend apart, absorbed, beside
    the prompts' flash attention (deepseek.paged_attention)."""
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=replace(EAGER, max_num_batched_tokens=24))
    mixed = []
    forward = llm.engine.forward  # (every step's, run from the host or launched ahead: pipeline.py)

    def spy(spans, *args, **kwargs):
        counts = [n for _, _, n in spans]
        mixed.append(1 in counts and max(counts) > 1)
        return forward(spans, *args, **kwargs)

    llm.engine.forward = spy
    got = llm.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    assert sum(mixed) >= 3, mixed
    assert_same_greedy(got, want, ONE_ULP)
