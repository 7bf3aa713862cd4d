"""Speculative decoding replayed from CUDA graphs (worker/engine/cuda_graphs.py): a verify
step (each sequence's pending token and its k drafts, a row each) replays the decode
graphs, and the drafter's steps (the MTP layer's, a draft model's) replay graphs of their
own. Greedy outputs are those of plain decoding with graphs (up to near ties: a verify row
and a one-token step may sum in another order) at batch 1, 16 and 64, with requests that
do not draft in the same steps, and with a cache too small for every draft. Sampled
requests, their drafts judged on the device, keep the target's distribution.

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

import json
from dataclasses import replace

import pytest
import torch
from draws import two_sample_p_value
from engine_steps import run_to_end
from greedy import ONE_ULP, assert_same_greedy

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence

pytestmark = pytest.mark.gpu

GRAPHS = EngineOptions(kv_cache_memory=256 << 20, enable_prefix_caching=False, max_num_seqs=64)


def spec(k: int, method: str = "mtp", **kw) -> EngineOptions:
    config = {"method": method, "num_speculative_tokens": k} | ({"model": str(BUNDLED_MODEL)} if method != "mtp" else {})
    return replace(GRAPHS, speculative_config=json.dumps(config), **kw)


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * i + j) % 500 + 3 for j in range(4 + i % 29)] for i in range(batch)]


@pytest.fixture(scope="module")
def plain():
    return LLM(BUNDLED_MODEL, device="cuda", engine=GRAPHS)


def counted(graphs) -> list[int]:
    """The rows of every replay of `graphs` from now on."""
    seen, replay = [], graphs.replay_rows

    def spy(rows, *args, **kw):
        seen.append(len(rows))
        return replay(rows, *args, **kw)

    graphs.replay_rows = spy
    return seen


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_verify_and_draft_steps_replay_graphs_with_the_greedy_tokens_of_plain_decoding(plain, method, k, batch):
    want = plain.generate(prompts(batch), max_tokens=24, logprobs=5, ignore_eos=True)
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=spec(k, method))
    target, drafter = counted(llm.graphs), counted(llm.draft_graphs)
    assert_same_greedy(llm.generate(prompts(batch), max_tokens=24, ignore_eos=True), want, ONE_ULP)
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens <= s.spec_draft_tokens and s.kv_blocks_used == 0
    assert max(target) > batch, target  # verify steps: more rows than sequences, replayed
    # the drafter's steps too: one (or more) after each verify step but the last; the first
    # drafts come with the prompt's step, whose token is the first of the 24
    assert len(drafter) >= -(-(24 - 1) // (k + 1)) - 1, drafter
    if method == "draft_model":  # a twin of the target drafts what the target says, but at
        # other row counts, whose bf16 sums differ in the last place: at a near tie the two
        # disagree (H100: 7 of 294 drafts refused at batch 16, k 3; 3 of 768 at 64, k 1)
        assert s.spec_accepted_tokens >= 0.95 * s.spec_draft_tokens


def test_requests_that_do_not_draft_share_the_replayed_steps(plain):
    """Half the requests ask for log-probs (they never draft): their one row a step sits
    beside the others' k + 1 in the same replays, and every output is plain decoding's."""
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=spec(2))
    target = counted(llm.graphs)
    batch = prompts(16)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=5 if i % 2 else None) for i in range(16)]
    got = run_to_end(llm.engine, [Sequence(p, q) for p, q in zip(batch, params)])
    want = plain.generate(batch, max_tokens=20, logprobs=5, ignore_eos=True)
    assert_same_greedy(list(got.values()), want, ONE_ULP)
    assert any(16 < rows < 16 * 3 for rows in target), target  # drafting and non-drafting rows in one replay
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_a_full_cache_with_drafts_preempts_and_finishes_in_graphs(plain):
    """Eight sequences of 60 tokens wanting 100 more, three drafts a step, 40 blocks."""
    from preload.worker.model.kv_cache import bytes_per_token

    per_block = 16 * bytes_per_token(plain.config, plain.config.num_layers + 1, plain.dtype)
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=spec(3, kv_cache_memory=40 * per_block, max_num_seqs=8))
    assert llm.engine.blocks.num_blocks == 40
    target = counted(llm.graphs)
    batch = [[10 + i] * 60 for i in range(8)]
    got = llm.generate(batch, max_tokens=100, ignore_eos=True)
    assert_same_greedy(got, plain.generate(batch, max_tokens=100, logprobs=5, ignore_eos=True), ONE_ULP, most=False)
    s = llm.engine.stats()
    assert s.preemptions > 0 and s.kv_blocks_used == 0 and not llm.engine.has_work() and target


def test_sampled_requests_with_drafts_keep_the_targets_distribution_on_the_gpu(plain):
    """Sampled requests judged on the device (speculative.judge): 512 copies of one prompt,
    temperature 1 and top-k 4, with 2 MTP drafts a step and without: at each position past
    the first the tokens are distributed alike (two-sample chi-square at 1e-4), and some
    drafts are kept and some refused. (Seeded repeats are the CPU tests': a GPU's sums may
    round differently from one run to the next.)"""
    torch.manual_seed(0)
    kw = dict(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=spec(2, max_num_seqs=256))
    many = [[5, 6, 7, 8]] * 512
    drafted, alone = llm.generate(many, **kw), plain.generate(many, **kw)
    for pos in (1, 2, 3):
        assert two_sample_p_value([o.token_ids[pos] for o in drafted], [o.token_ids[pos] for o in alone]) > 1e-4, pos
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_drafted_steps_are_launched_ahead_with_the_greedy_tokens_of_plain_decoding(plain, method, monkeypatch):
    """--drafts-ahead (drafts_ahead.py): verify steps launched while the step before flies,
    their rows moved on on the device by the drafts that step keeps; the greedy outputs of
    plain decoding at batch 16, and (drafts counted once verified) the draft model twin's
    drafts nearly all kept, as one step at a time keeps them. Its graphs are captured anew
    (they shift their rows), not those of an engine before it without --drafts-ahead; with
    3 drafts the drafter fills its graphs three times a step."""
    from preload.worker.engine import drafts_ahead, pipeline

    launches, launch = [0, 0], drafts_ahead.launch_drafted  # (from the host, while another flew)

    def counting(e, batch, before):
        launches[before is not None] += 1
        return launch(e, batch, before)

    monkeypatch.setattr(pipeline, "launch_drafted", counting)
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=spec(3, method))
    llm.generate(prompts(2), max_tokens=8, ignore_eos=True)
    llm.start_engine(spec(3, method, drafts_ahead=True))
    want = plain.generate(prompts(16), max_tokens=40, logprobs=5, ignore_eos=True)
    assert_same_greedy(llm.generate(prompts(16), max_tokens=40, ignore_eos=True), want, ONE_ULP)
    assert launches[1] >= 5 and launches[1] > launches[0], launches
    s = llm.engine.stats()
    assert s.spec_accepted_tokens >= (0.95 if method == "draft_model" else 0.01) * s.spec_draft_tokens > 0
