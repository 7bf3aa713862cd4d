"""Speculative decoding with the checkpoint's MTP layer or a separate draft model (loaded
beside the target, or attached from another daemon): greedy outputs are exactly those of
decoding one token a step, with and without prefix-cache hits, whatever the number of
drafts; sampled outputs keep the target's distribution (checked on the acceptance rule
itself, many draws, and on the engine's outputs against decoding without drafts); a cache too small for everyone makes the scheduler drop drafts and
preempt, and every request still finishes with the same answer. The operator's logits
processors shape the drafts and their verification: outputs are those of the processors
alone, greedy and sampled."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from draws import two_sample_p_value
from engine_steps import run_to_end

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.sampler import distribution
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.engine.speculative import SpecConfig, accept, fed_tokens, judge
from preload.worker.model.kv_cache import bytes_per_token

BASE = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], list(range(100, 140)), [9] * 20]


def mtp(k: int, **kw) -> EngineOptions:
    return replace(BASE, speculative_config=f'{{"method": "mtp", "num_speculative_tokens": {k}}}', **kw)


@pytest.fixture(scope="module")
def plain():
    return LLM(BUNDLED_MODEL, dtype="float32", engine=BASE)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_outputs_equal_decoding_without_drafts(plain, k):
    want = plain.generate(PROMPTS, max_tokens=40, ignore_eos=True)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(k))
    got = llm.generate(PROMPTS, max_tokens=40, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    s = llm.engine.stats()
    assert s.spec_draft_tokens > 0 and 0 < s.spec_accepted_tokens <= s.spec_draft_tokens  # the trained MTP is right often
    assert s.kv_blocks_used == 0


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_drafts_are_chained_and_verified_on_the_device_and_copied_with_the_judging(plain, method, monkeypatch):
    """Without processors, greedy and sampled requests' k drafts alike: each the next draft
    step's input where it lies (speculative.Drafter.chain), left there for the verify step,
    which reads them there (Engine.forward), and brought to the host with the judged tokens
    in one copy (judge): never read back on their own (Sequence.resolve_drafts). Drawing on
    the host, draft by draft, is left to the operator's processors (`_draw`). Greedy outputs
    are plain decoding's; sampled ones' drafts are kept too."""
    from preload.worker.engine.sequence import Sequence
    from preload.worker.engine.speculative import Drafter

    monkeypatch.setattr(Sequence, "resolve_drafts", lambda self: pytest.fail("drafts read back on their own"))

    engine = mtp(3) if method == "mtp" else replace(BASE, speculative_config=json.dumps(
        {"method": "draft_model", "model": str(Path(BUNDLED_MODEL).parent / "tiny-v3-draft"), "num_speculative_tokens": 3}))
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=engine)
    monkeypatch.setattr(Drafter, "_draw", lambda *a: pytest.fail("drawn on the host"))
    got = llm.generate(PROMPTS, max_tokens=30, ignore_eos=True)
    want = plain.generate(PROMPTS, max_tokens=30, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    greedy = llm.engine.stats()
    assert 0 < greedy.spec_accepted_tokens <= greedy.spec_draft_tokens
    sampled = llm.generate(PROMPTS, max_tokens=30, temperature=0.7, top_k=20, ignore_eos=True)
    assert [len(x.token_ids) for x in sampled] == [30] * len(PROMPTS)
    assert llm.engine.stats().spec_accepted_tokens > greedy.spec_accepted_tokens  # (sampled drafts kept too)


def test_with_prefix_cache_hits_and_stops_mid_draft(plain):
    """max_tokens and EOS end a sequence inside an accepted run of drafts: nothing past them."""
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(3, enable_prefix_caching=True))
    system = list(range(200, 264))
    prompts = [system + [5, 6], system + [7, 8], system + [9]]
    for max_tokens in (1, 2, 5, 13):
        got = llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
        want = plain.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert all(len(g.token_ids) == max_tokens for g in got)
    assert llm.engine.stats().prefix_hit_tokens > 0
    free = plain.generate(prompts, max_tokens=60)  # stops at EOS, if the model says it
    assert [g.token_ids for g in llm.generate(prompts, max_tokens=60)] == [w.token_ids for w in free]


def test_drafts_after_prefix_hits_are_as_good_whoever_filled_the_blocks():
    """A drafting request whose prompt hits blocks that a request without drafts filled (it
    asked for log-probs) drafts from the drafter's latents of them as well: it has as many
    drafts accepted as after blocks a drafting request filled."""
    system = list(range(300, 364))  # four full blocks of 16

    def accepted_after(**filler) -> int:
        llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(3, enable_prefix_caching=True))
        llm.generate([system + [1]], max_tokens=2, ignore_eos=True, **filler)
        before = llm.engine.stats().spec_accepted_tokens
        llm.generate([system + [2, 3]], max_tokens=24, ignore_eos=True)
        s = llm.engine.stats()
        assert s.prefix_hit_tokens >= len(system)
        return s.spec_accepted_tokens - before

    assert accepted_after(logprobs=1) == accepted_after() > 0


def test_requests_that_cannot_speculate_run_beside_those_that_do(plain):
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(2))
    kinds = [dict(logprobs=2), dict(repetition_penalty=1.3), dict()]
    for kw in kinds:
        got = llm.generate(PROMPTS, max_tokens=12, ignore_eos=True, **kw)
        want = plain.generate(PROMPTS, max_tokens=12, ignore_eos=True, **kw)
        assert [g.token_ids for g in got] == [w.token_ids for w in want], kw


def test_a_seeded_sampled_request_gets_the_tokens_it_gets_without_drafts_at_any_load(plain):
    """Its tokens through drafts would depend on the drafts (how many fit, whether it was
    preempted), not on the seed alone: it does not speculate, and draws what decoding
    without drafts draws, alone and in a crowd of greedy requests that speculate and make a
    cache of 32 blocks of 4 preempt it. (Drafted, its tokens differed under the crowd.)"""
    kw = dict(max_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    want = plain.generate(PROMPTS[:1], **kw)[0].token_ids
    assert LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(2)).generate(PROMPTS[:1], **kw)[0].token_ids == want
    per_token = bytes_per_token(plain.engine.model.cfg, plain.engine.model.cfg.num_layers + 1, torch.float32)
    small = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(2, kv_cache_memory=32 * 4 * per_token, block_size=4))
    seeded = Sequence(PROMPTS[0], SamplingParams(**kw))
    crowd = [Sequence([10 + i] * 30, SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(6)]
    assert run_to_end(small.engine, [seeded, *crowd])[seeded.id].token_ids == want
    s = small.engine.stats()
    assert s.preemptions > 0 and s.spec_accepted_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """One draft drawn from q, judged against p: the token that comes out is distributed as
    p (the acceptance rule of Leviathan et al.), here over 40,000 draws of an 8-token vocab,
    judged in one batch."""
    torch.manual_seed(0)
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5], [0.0] * 8])
    params = SamplingParams(temperature=1.0, max_tokens=4)
    p = distribution(target[0], params)
    q = torch.tensor([0.05, 0.4, 0.05, 0.2, 0.1, 0.1, 0.05, 0.05])
    seqs = [Sequence([1], params, drafts=[int(d)], draft_probs=[q]) for d in torch.multinomial(q, 40_000, replacement=True)]
    assert accept(target, seqs[0])[0] in range(8)  # (one alone, as the engine judges with processors)
    counts = torch.bincount(torch.tensor([got[0] for got in judge(target.repeat(len(seqs), 1), seqs)]), minlength=8)
    freq = counts / counts.sum()
    assert torch.allclose(freq, p, atol=0.01), (freq, p)
    # (the draft distribution is far from it: accepting every draft would fail this)
    assert not torch.allclose(q, p, atol=0.05)


def test_drafts_left_on_the_device_are_fed_and_judged_where_they_lie_and_read_back_on_demand():
    """Drafts the drafter left in a tensor (Sequence.draft_at, placeholders in `drafts`): the
    verify step's tokens take them from there (fed_tokens), judging brings their values
    with the judged tokens (judge: greedy and sampled alike), dropping drafts drops their
    indices, and any other read of the tokens brings them to the host first."""
    def drafted(temperature: float) -> Sequence:
        seq = Sequence([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=9), output=[4])
        seq.drafts, seq.draft_at = [-1, -1], (torch.tensor([7, 8, 9, 10]), [1, 3])
        if temperature:
            seq.draft_probs = [torch.full((12,), 1 / 12)] * 2
        return seq

    seq = drafted(0.0)
    assert fed_tokens([(seq, 3, 3)], torch.device("cpu")).tolist() == [4, 8, 10] and seq.draft_at is not None
    rows = torch.full((3, 12), -9.0).index_put_((torch.arange(3), torch.tensor([8, 11, 5])), torch.tensor(0.0))
    assert judge(rows, [seq]) == [[8, 11]] and seq.drafts == [8, 10] and seq.draft_at is None
    sampled = drafted(0.8)
    judge(rows.log_softmax(-1), [sampled])
    assert sampled.drafts == [8, 10] and sampled.draft_at is None
    seq = drafted(0.0)
    seq.keep_drafts(1)
    assert seq.draft_at[1] == [1] and seq.tokens(2, 5) == [3, 4, 8] and seq.draft_at is None
    seq.keep_drafts(0)
    assert seq.drafts == [] and seq.draft_at is None


def test_a_steps_drafts_judged_together_are_judged_as_each_alone():
    """speculative.judge over a step's verifying sequences at once (greedy and sampled, 1
    to 3 drafts each, one copy to the host) gives each greedy one the tokens it gets judged
    alone: its drafts while they are the argmax, then the argmax; each sampled one some of
    its drafts, in order, and one token more (their distribution: the tests above)."""
    torch.manual_seed(0)
    vocab, seqs, rows = 40, [], []
    for i, (temperature, k) in enumerate([(0.0, 2), (0.9, 3), (1.0, 1), (0.0, 3), (0.7, 2), (1.0, 3)]):
        params = SamplingParams(temperature=temperature, top_k=12 if temperature else 0, max_tokens=8)
        seq = Sequence([1, 2], params, output=[3] * i)
        r = (torch.randn(k + 1, vocab) * 3).log_softmax(-1)
        if temperature:
            seq.draft_probs = [distribution(r[j] + torch.randn(vocab), params) for j in range(k)]
            seq.drafts = [int(torch.multinomial(q, 1)) for q in seq.draft_probs]
        else:
            seq.drafts = r.argmax(-1)[:k].tolist()
            seq.drafts[k - 1] = (seq.drafts[k - 1] + 1) % vocab  # (the last draft wrong)
        seqs.append(seq)
        rows.append(r)
    together = judge(torch.cat(rows), seqs)
    alone = [judge(r, [s])[0] for r, s in zip(rows, seqs)]
    assert [t for t, s in zip(together, seqs) if s.params.greedy] == [a for a, s in zip(alone, seqs) if s.params.greedy]
    for seq, r, got in zip(seqs, rows, together):
        k = len(seq.drafts)
        if seq.params.greedy:
            assert got == seq.drafts[: k - 1] + [int(r[k - 1].argmax())]
        else:
            assert 1 <= len(got) <= k + 1 and got[:-1] == seq.drafts[: len(got) - 1]
    assert any(len(got) > 1 for seq, got in zip(seqs, together) if not seq.params.greedy)  # (some draft kept)


def test_sampled_outputs_keep_the_targets_distribution_end_to_end(plain):
    """The engine, not the rule alone: 600 copies of one prompt sampled (temperature 1,
    top-k 4) with 2 MTP drafts a step and without; at each position past the first (a
    draft accepted, or a draw from the residual) the tokens are distributed alike (a
    two-sample chi-square test at 1e-4: a correct engine fails it for one seed in 10,000).
    Checked by hand that it catches the likely mistakes: accepting every draft (p = 0 at
    the second token), replacing a refused draft by a draw from p instead of the residual
    (p = 3e-7 at the third)."""
    torch.manual_seed(0)
    prompts, kw = [[5, 6, 7, 8]] * 600, dict(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(2, max_num_seqs=256))
    drafted = llm.generate(prompts, **kw)
    plain_ = plain.generate(prompts, **kw)
    for pos in (1, 2, 3):
        p = two_sample_p_value([o.token_ids[pos] for o in drafted], [o.token_ids[pos] for o in plain_])
        assert p > 1e-4, (pos, p)
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # drafts both kept and refused


def test_a_full_cache_with_drafts_preempts_and_finishes(plain):
    """Eight sequences, three drafts each a step, a cache of 40 blocks of 16: drafts are
    dropped when there is no room for them, sequences preempted, and all finish alike."""
    cfg = plain.config
    layers = cfg.num_layers + 1  # with the drafter's layer
    per_block = 16 * bytes_per_token(cfg, layers, torch.float32)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=mtp(3, kv_cache_memory=40 * per_block, max_num_seqs=8))
    assert llm.engine.blocks.num_blocks == 40
    prompts = [[10 + i] * 60 for i in range(8)]
    got = llm.generate(prompts, max_tokens=100, ignore_eos=True)
    want = plain.generate(prompts, max_tokens=100, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    s = llm.engine.stats()
    assert s.preemptions > 0 and s.kv_blocks_used == 0 and not llm.engine.has_work()


@pytest.mark.parametrize("text, says", [
    ("not json", "not JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'mtp' .* or 'draft_model'"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "1 to 8"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}', "takes method, num_spec"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "takes one of model"),
    ('{"model": "/a", "state_dir": "/b", "num_speculative_tokens": 2}', "takes one of model"),
    ('{"method": "mtp", "model": "/a", "num_speculative_tokens": 2}', "'mtp' takes neither"),
])
def test_a_bad_speculative_config_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match=says):
        SpecConfig.parse(text)


def draft_spec(k: int, **where) -> EngineOptions:
    return replace(BASE, speculative_config=json.dumps({"method": "draft_model", "num_speculative_tokens": k} | where))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A random two-layer V2 model with the bundled model's vocabulary: a poor drafter."""
    from checkpoints import make_hf_model, save_hf_model

    vocab = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())["vocab_size"]
    return save_hf_model(make_hf_model("v2", seed=3, vocab_size=vocab, num_hidden_layers=2),
                         tmp_path_factory.mktemp("draft"))


def test_a_draft_model_gives_the_same_greedy_outputs(plain, small_draft):
    want = plain.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    poor = LLM(BUNDLED_MODEL, dtype="float32", engine=draft_spec(3, model=str(small_draft)))
    assert [g.token_ids for g in poor.generate(PROMPTS, max_tokens=24, ignore_eos=True)] == [w.token_ids for w in want]
    assert poor.engine.stats().spec_draft_tokens > 0
    twin = LLM(BUNDLED_MODEL, dtype="float32", engine=draft_spec(2, model=BUNDLED_MODEL))  # drafts what it will say
    assert [g.token_ids for g in twin.generate(PROMPTS, max_tokens=24, ignore_eos=True)] == [w.token_ids for w in want]
    s = twin.engine.stats()
    assert s.spec_accepted_tokens == s.spec_draft_tokens > 0


def test_a_draft_model_attached_from_another_daemon(plain, small_draft, tmp_path):
    from daemons import running_daemon

    with running_daemon(tmp_path / "draft-state", small_draft, "--dtype", "float32") as d:
        llm = LLM(BUNDLED_MODEL, dtype="float32", engine=draft_spec(2, state_dir=str(d.state_dir)))
        got = llm.generate(PROMPTS, max_tokens=16, ignore_eos=True)
        assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(PROMPTS, max_tokens=16, ignore_eos=True)]
        assert d.status()["attached_workers"] == [os.getpid()]  # zero-copy: this process maps the daemon's arena
        llm.close()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(BUNDLED_MODEL, dtype="float32", engine=draft_spec(2, model=str(tiny_checkpoint)))


BAN = "preload.worker.engine.logits_processors:BanTokens"


class NoRepeat:
    """Bans each row's last generated token: a processor that reads the tokens so far, which
    for a verified draft's row are the output and the drafts before it."""

    def __init__(self, context):
        pass

    def __call__(self, logits, batch):
        for i, out in enumerate(batch.outputs):
            if out:
                logits[i, out[-1]] = float("-inf")
        return logits


def processing(options: EngineOptions, *specs: str) -> EngineOptions:
    return replace(options, logits_processors=specs)


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_logits_processors_shape_the_drafts_and_their_verification(plain, method):
    """With processors, speculative decoding gives exactly the greedy output of the
    processors alone: a banned token is never proposed, accepted or emitted, and a
    processor reading the tokens so far sees the drafts before a row as generated. A twin
    draft model (the target itself) then has every draft accepted: its proposals are shaped too."""
    want = plain.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    banned = sorted({t for w in want for t in w.token_ids[2:5]})  # tokens the model does pick
    specs = (f'{BAN}={{"token_ids": {banned}}}', f"{__name__}:NoRepeat")
    alone = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(BASE, *specs))
    expected = [a.token_ids for a in alone.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
    assert expected != [w.token_ids for w in want]  # the processors change the outputs
    spec = mtp(2) if method == "mtp" else draft_spec(2, model=BUNDLED_MODEL)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(spec, *specs))
    got = [g.token_ids for g in llm.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
    assert got == expected
    assert all(not set(g) & set(banned) and all(a != b for a, b in zip(g, g[1:])) for g in got)
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens <= s.spec_draft_tokens
    if method == "draft_model":
        assert s.spec_accepted_tokens == s.spec_draft_tokens


def test_sampled_outputs_with_processors_keep_their_distribution_with_drafts(plain):
    """As the end-to-end test above, with a processor banning the token the model likes most
    at the second position: with 2 MTP drafts a step and without, the same distribution at
    each position (chi-square at 1e-4), and the banned token never drawn."""
    torch.manual_seed(1)
    prompt = [5, 6, 7, 8]
    banned = plain.generate([prompt], max_tokens=2, ignore_eos=True)[0].token_ids[1:]
    prompts, kw = [prompt] * 600, dict(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    spec = f'{BAN}={{"token_ids": {banned}}}'
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(mtp(2, max_num_seqs=256), spec))
    drafted = llm.generate(prompts, **kw)
    alone = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(replace(BASE, max_num_seqs=256), spec)).generate(prompts, **kw)
    for pos in (1, 2, 3):
        p = two_sample_p_value([o.token_ids[pos] for o in drafted], [o.token_ids[pos] for o in alone])
        assert p > 1e-4, (pos, p)
    assert all(banned[0] not in o.token_ids for o in drafted + alone)
    s = llm.engine.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens


class BanAll:
    """Leaves no token to draw from."""

    def __init__(self, context):
        pass

    def __call__(self, logits, batch):
        return torch.full_like(logits, float("-inf"))


def test_a_processor_leaving_nothing_to_draw_stops_the_drafts_not_the_engine():
    """The drafter draws from the processed rows: where nothing can be drawn (a sampled
    request's distribution of no tokens) it drafts nothing for the step, and the requests
    come out as with the processor alone (whose sampler then picks token 0)."""
    kw = dict(max_tokens=4, temperature=1.0, ignore_eos=True)  # (no seed: a seeded request would not draft)
    alone = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(BASE, f"{__name__}:BanAll")).generate(PROMPTS[:2], **kw)
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=processing(mtp(2), f"{__name__}:BanAll"))
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], **kw)] == [a.token_ids for a in alone]
    s = llm.engine.stats()
    assert s.spec_draft_tokens == 0 and not llm.engine.has_work() and s.kv_blocks_used == 0
