"""Prompt steps replayed piecewise from CUDA graphs (worker/engine/prompt_graphs.py): a
step of prompt tokens, alone, with cached context or beside decode rows, gives the
hidden states the eager forward gives (to bf16 rounding: a bucket's GEMMs are other
shapes), its padding rows write only the scratch block, and through the engine the
greedy tokens are the eager engine's.

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

from dataclasses import replace

import pytest
import torch
from greedy import assert_same_greedy

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.prompt_graphs import PromptGraphs, token_buckets
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.model.kv_cache import AttentionMeta

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["none", "fp8_block"])
def pair(request):
    """The bundled model on the GPU twice: with graphs (decode and prompt steps), and eager."""
    options = EngineOptions(kv_cache_memory=64 << 20, max_num_seqs=40, max_num_batched_tokens=512)
    graphed = LLM(BUNDLED_MODEL, device="cuda", quant=request.param, engine=options)
    eager = LLM(BUNDLED_MODEL, device="cuda", quant=request.param, engine=replace(options, enforce_eager=True))
    return graphed, eager


def test_buckets_end_at_the_token_budget():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert token_buckets(600)[-2:] == [512, 600]
    assert token_buckets(100_000)[-1] == 8192


def sequences(engine, lengths: list[int], seed: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        seq = Sequence(torch.randint(3, 2000, (n,), generator=gen).tolist(), SamplingParams(max_tokens=1))
        engine.blocks.grow(seq, n)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("layout", ["one prompt", "prompts and cached context", "mixed with decode rows"])
def test_a_replayed_step_gives_the_eager_hidden_states_and_writes_only_real_slots(pair, layout):
    graphed, _ = pair
    engine = graphed.engine
    prompts: PromptGraphs = engine.prompt_graphs
    lengths = {"one prompt": [37], "prompts and cached context": [100, 60, 9], "mixed with decode rows": [50, 80, 3, 120]}
    seqs = sequences(engine, lengths[layout], seed=len(layout))
    # (start, n) of each: cached context computed before (eagerly), then the step under test
    if layout == "one prompt":
        spans = [(0, 37)]
    elif layout == "prompts and cached context":
        spans = [(64, 36), (0, 60), (0, 9)]
    else:
        spans = [(49, 1), (79, 1), (0, 3), (17, 103)]
    try:
        dev, bs = engine.device, engine.blocks.block_size
        before = [(seq, 0, start) for seq, (start, _) in zip(seqs, spans) if start]
        if before:
            engine.forward(before, [0])
        tokens = torch.tensor([t for seq, (s, n) in zip(seqs, spans) for t in seq.tokens(s, s + n)], device=dev)
        meta = AttentionMeta.build([(s, n, seq.blocks) for seq, (s, n) in zip(seqs, spans)], bs, dev)
        want = engine.model.forward(tokens, meta, engine.cache)
        pools = [p.clone() for p in engine.cache.c_kv]
        got = prompts.forward(tokens, meta, engine.cache, engine.scratch_block * bs).clone()
        assert prompts.bucket(len(tokens)) in prompts.graphs
        assert got.shape == want.shape
        assert torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2), (got - want).abs().max()
        real = engine.scratch_block * bs  # the slots below are the engine's; the scratch block's are above
        for layer, pool in enumerate(engine.cache.c_kv):
            assert torch.allclose(pool[:real].float(), pools[layer][:real].float(), atol=5e-2, rtol=5e-2), layer
    finally:
        for seq in seqs:
            engine.blocks.release(seq)


@pytest.mark.parametrize("count", [1, 5, 23])
def test_the_engine_with_prompt_graphs_gives_the_eager_greedy_tokens(pair, count):
    graphed, eager = pair
    replayed, forward = [], graphed.engine.prompt_graphs.forward
    graphed.engine.prompt_graphs.forward = lambda tokens, *a: replayed.append(len(tokens)) or forward(tokens, *a)
    try:
        gen = torch.Generator().manual_seed(count)
        batch = [torch.randint(3, 2000, (int(n),), generator=gen).tolist()
                 for n in torch.randint(20, 400, (count,), generator=gen)]
        got = graphed.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
        want = eager.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    finally:
        del graphed.engine.prompt_graphs.forward  # (the method again)
    assert replayed and max(replayed) > count  # the prompts' steps were replayed
    assert_same_greedy(got, want)


def test_prompt_graphs_captured_against_a_warm_up_cache_serve_the_slots_cache():
    """As a spare does (worker/serve.py, capture_prompt_graphs): every bucket captured while
    its engine has a cache of a few blocks, then a cache 16x larger for its slot; the same
    pieces are replayed (their cache writes go through the address table) and the greedy
    tokens are eager's."""
    options = EngineOptions(kv_cache_memory=4 << 20, max_num_seqs=8, max_num_batched_tokens=512)
    spare = LLM(BUNDLED_MODEL, device="cuda", engine=options)
    captures = 0
    while spare.engine.capture_idle():
        captures += 1
    prompt_graphs = spare.engine.prompt_graphs
    assert captures and not prompt_graphs.pending and sorted(prompt_graphs.graphs) == token_buckets(512)
    spare.start_engine(replace(options, kv_cache_memory=64 << 20))
    assert spare.engine.prompt_graphs is prompt_graphs and spare.engine.graphs_pending() == 0
    eager = LLM(BUNDLED_MODEL, device="cuda", engine=replace(options, kv_cache_memory=64 << 20, enforce_eager=True))
    replayed, forward = [], prompt_graphs.forward
    prompt_graphs.forward = lambda tokens, *a: replayed.append(len(tokens)) or forward(tokens, *a)
    try:
        gen = torch.Generator().manual_seed(5)
        batch = [torch.randint(3, 2000, (int(n),), generator=gen).tolist()
                 for n in torch.randint(20, 400, (5,), generator=gen)]
        got = spare.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
        want = eager.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    finally:
        del prompt_graphs.forward
    assert replayed and not prompt_graphs.pending  # replayed, nothing captured for the new cache
    assert_same_greedy(got, want)
