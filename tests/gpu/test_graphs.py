"""CUDA graphs: a replayed decode step gives what the eager step gives, for every batch
size bucket, with padding rows that touch only the scratch block, and after the engine's
cache is replaced (a spare captures against its warm-up cache, then takes a slot and
allocates its real one).

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

import gc
import subprocess
import sys
import weakref
from dataclasses import replace

import pytest
import torch
from engine_steps import run_to_end
from greedy import assert_same_greedy

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.engine.cuda_graphs import captured
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence

pytestmark = pytest.mark.gpu


def prompts(count: int, seed: int = 0, longest: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, longest, (count,), generator=gen)]


def counted_replays(llm: LLM) -> list[int]:
    """Record the batch size of every replay of `llm`'s graphs."""
    calls, replay = [], llm.graphs.replay
    llm.graphs.replay = lambda batch, *rest: calls.append(len(batch)) or replay(batch, *rest)
    return calls


@pytest.fixture(scope="module", params=["auto", "fp8"], ids=["bf16-cache", "fp8-cache"])
def pair(request):
    """The bundled model on the GPU twice: with graphs, and eager."""
    options = EngineOptions(kv_cache_memory=64 << 20, max_num_seqs=40, kv_cache_dtype=request.param)
    graphed = LLM(BUNDLED_MODEL, device="cuda", engine=options)
    eager = LLM(BUNDLED_MODEL, device="cuda", engine=replace(options, enforce_eager=True))
    return graphed, eager


def test_graphs_are_captured_for_every_bucket_unless_eager(pair):
    graphed, eager = pair
    assert eager.graphs is None
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("count", [1, 3, 17, 40])
def test_graphs_and_eager_give_identical_greedy_tokens(pair, count):
    graphed, eager = pair
    calls = counted_replays(graphed)
    batch = prompts(count, seed=count)
    got = graphed.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True)
    want = eager.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True)
    assert calls and max(calls) == count  # the decode steps were replayed, padded to a bucket
    assert_same_greedy(got, want)
    # The first replayed step reads the same cache as the eager one: its log-probs agree to
    # bf16 rounding. Later steps read caches written by slightly different sums (a bucket's
    # GEMMs and attention splits differ), a drift the fp8 cache amplifies: tokens only.
    first = torch.tensor([g.logprobs[1] for g in got]), torch.tensor([w.logprobs[1] for w in want])
    assert torch.allclose(*first, atol=2e-2, rtol=2e-2), (first[0] - first[1]).abs().max()


@pytest.mark.parametrize("count", [1, 17])
def test_steps_launched_ahead_give_exactly_what_steps_one_at_a_time_give(pair, count):
    """--async-scheduling (on by default on a GPU) replays the same graphs with the same
    inputs, the tokens copied on the device instead of from the host: the same bits."""
    graphed, _ = pair
    pipeline = graphed.engine.pipeline
    assert pipeline is not None
    launched, launch = [], pipeline._launch
    pipeline._launch = lambda batch, before: (launched.append(before is not None), launch(batch, before))[1]
    batch = prompts(count, seed=count + 1)
    graphed.generate(batch, max_tokens=1)  # (so that every run below finds the prompts' blocks in the prefix cache)
    try:
        ahead = graphed.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True, seed=3, temperature=0.7)
        greedy_ahead = graphed.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True)
        graphed.engine.pipeline = None
        alone = graphed.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True, seed=3, temperature=0.7)
        greedy_alone = graphed.generate(batch, max_tokens=24, logprobs=5, ignore_eos=True)
    finally:
        graphed.engine.pipeline = pipeline
        del pipeline._launch
    assert any(launched)
    for a, b in zip(ahead + greedy_ahead, alone + greedy_alone):
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


def test_requests_ending_by_length_at_different_steps_give_what_steps_one_at_a_time_give(pair):
    """Requests of 5 to 29 tokens, greedy and seeded: each end by length leaves the others
    launched ahead, their draws picked on the device; the same bits as one at a time."""
    graphed, _ = pair
    engine, pipeline = graphed.engine, graphed.engine.pipeline

    def make():
        return [Sequence(p, SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True, logprobs=3, seed=i,
                                           temperature=0.7 if i % 2 else 0.0))
                for i, p in enumerate(prompts(9, seed=5))]

    # (so that both runs find the prompts' full blocks in the prefix cache and compute the
    # same tails: the first run to see a prompt computes all of it, in steps of other shapes)
    run_to_end(engine, [Sequence(p, SamplingParams(max_tokens=1)) for p in prompts(9, seed=5)])
    ahead = run_to_end(engine, make())
    engine.pipeline = None
    try:
        alone = run_to_end(engine, make())
    finally:
        engine.pipeline = pipeline
    assert [len(o.token_ids) for o in ahead.values()] == [5 + 3 * i for i in range(9)]
    for a, b in zip(ahead.values(), alone.values()):
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


def test_graphs_serve_a_new_cache_after_capture():
    """Captured against a cache of a few blocks, replayed against one 16x larger with
    contexts that would not have fitted the first: only the addresses in the graphs'
    pointer table changed."""
    small = EngineOptions(kv_cache_memory=4 << 20, max_num_seqs=8)
    graphed = LLM(BUNDLED_MODEL, device="cuda", engine=small)
    graphs = graphed.graphs
    small_blocks = graphed.engine.blocks.num_blocks
    graphed.start_engine(EngineOptions(kv_cache_memory=64 << 20, max_num_seqs=8))
    assert graphed.graphs is graphs and graphed.engine.blocks.num_blocks >= 16 * small_blocks
    eager = LLM(BUNDLED_MODEL, device="cuda", engine=EngineOptions(kv_cache_memory=64 << 20, max_num_seqs=8,
                                                                   enforce_eager=True))
    calls = counted_replays(graphed)
    batch = prompts(6, seed=7, longest=3000)
    got = graphed.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    want = eager.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    assert calls
    assert_same_greedy(got, want)


def test_graphs_are_captured_again_for_a_new_cache_where_attention_reads_the_pools_directly(model_dir):
    """The conftest's model has rope parts of 8 dimensions, which the Triton decode kernel
    does not take: torch's reference reads the pools' own tensors, so a graph of it would
    go on reading the first cache (a spare's warm-up cache, freed when it takes its slot:
    it served other text than the worker it replaced). A new engine captures new graphs."""
    options = EngineOptions(kv_cache_memory=4 << 20, max_num_seqs=8)
    graphed = LLM(model_dir, device="cuda", engine=options)
    first = graphed.graphs
    graphed.start_engine(replace(options, kv_cache_memory=64 << 20))
    assert graphed.graphs is not first and graphed.graphs.graphs
    eager = LLM(model_dir, device="cuda", engine=replace(options, kv_cache_memory=64 << 20, enforce_eager=True))
    gen = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    calls = counted_replays(graphed)
    got = graphed.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    want = eager.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    assert calls
    assert_same_greedy(got, want)


def test_a_lazy_start_captures_the_largest_graph_then_each_other_at_first_use_or_while_idle():
    """A worker a slot waits for (lazy_graphs) is ready with the largest bucket alone, which
    every decode batch fits; a bucket is captured at its first use (a busy engine would
    otherwise pad every batch to the largest for good), and the rest one per idle turn,
    smallest first, against the engine's real cache. The tokens are eager's throughout."""
    options = EngineOptions(kv_cache_memory=4 << 20, max_num_seqs=40)
    lazy = LLM(BUNDLED_MODEL, device="cuda", engine=options, lazy_graphs=True)
    eager = LLM(BUNDLED_MODEL, device="cuda", engine=replace(options, kv_cache_memory=64 << 20, enforce_eager=True))
    assert sorted(lazy.graphs.graphs) == [40]
    lazy.start_engine(replace(options, kv_cache_memory=64 << 20))  # the slot's cache: nothing captured for it
    assert sorted(lazy.graphs.graphs) == [40]
    buckets, replay = [], lazy.graphs.replay
    lazy.graphs.replay = lambda batch, *rest: (
        buckets.append(min(s for s in lazy.graphs.graphs if s >= len(batch))) or replay(batch, *rest))
    batch = prompts(3, seed=11)
    want = eager.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True)
    assert_same_greedy(lazy.generate(batch, max_tokens=16, logprobs=5, ignore_eos=True), want)
    assert set(buckets) == {4} and sorted(lazy.graphs.graphs) == [4, 40]  # (three sequences: captured at first use)

    order = []
    pending = [lazy.engine.stats().graphs_pending]  # (what /metrics shows, and bench serve waits on)
    warmup = lazy.engine.warmup  # (attention_warmup.py: last, one shape a turn)
    assert pending[0] == len(lazy.graphs.pending) + len(lazy.engine.prompt_graphs.pending) + len(warmup.pending)
    while lazy.graphs.pending:
        assert lazy.engine.capture_idle()
        pending.append(lazy.engine.stats().graphs_pending)
        order.append(max(set(lazy.graphs.graphs) - set(order) - {4, 40}, default=None))
    assert order == [1, 2, 8, 16, 24, 32] and sorted(lazy.graphs.graphs) == [1, 2, 4, 8, 16, 24, 32, 40]
    # then the prompt steps' buckets, largest first, a few pieces a turn (prompt_graphs.py)
    prompt_graphs = lazy.engine.prompt_graphs
    largest = prompt_graphs.pending[-1]
    while largest not in prompt_graphs.graphs:
        assert prompt_graphs.pending[-1] == largest and lazy.engine.capture_idle()
    while prompt_graphs.pending:
        assert lazy.engine.capture_idle()
    shapes = len(warmup.pending)
    while warmup.pending:
        assert lazy.engine.capture_idle() and len(warmup.pending) == shapes - 1
        shapes -= 1
    assert pending == list(range(pending[0], pending[0] - 7, -1)) and lazy.engine.stats().graphs_pending == 0
    assert not lazy.engine.capture_idle()  # nothing left
    buckets.clear()
    one = eager.generate(batch[:1], max_tokens=16, logprobs=5, ignore_eos=True)
    assert_same_greedy(lazy.generate(batch[:1], max_tokens=16, logprobs=5, ignore_eos=True), one)
    assert set(buckets) == {1}


# A fresh process: the graphs of 16 decode buckets and of every prompt bucket, and what
# torch's allocator holds beyond the KV cache once they are captured.
CAPTURED = """
import torch
from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
llm = LLM(BUNDLED_MODEL, device="cuda", engine=EngineOptions(kv_cache_memory=64 << 20, max_num_seqs=256))
while llm.engine.capture_idle():
    pass
assert len(llm.graphs.graphs) == 16 and not llm.prompt_graphs.pending
print(torch.cuda.memory_reserved() - (64 << 20))
"""


def test_every_graph_of_a_process_shares_one_cublas_workspace_and_one_log_prob_buffer():
    """cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run on: graphs
    warmed up on streams of their own held one each (30 in a V2-Lite worker, ~1 GiB), and
    each decode bucket kept log-probs of its own. On the bundled model (its weights ~10
    MB) what a process holds beside its KV cache, all graphs captured, stays within a few
    workspaces' worth."""
    out = subprocess.run([sys.executable, "-c", CAPTURED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    held = int(out.stdout.split()[-1])
    assert held < 256 << 20, f"{held / 2**20:.0f} MiB held beside the KV cache"


def test_a_dead_graph_collected_as_garbage_cannot_fail_a_capture():
    """A graph no longer used but kept by a reference cycle dies when the garbage collector
    runs, and its destruction is a call the driver forbids during another capture: a
    collection inside a capture failed it (a test module's sixth engine, H100). Here a
    graph's last reference becomes a young dead cycle during a capture, and collections
    run at nearly every allocation."""
    x = torch.ones(8, device="cuda")
    pool = torch.cuda.graph_pool_handle()

    def drop_in_a_cycle(held):
        cycle = [held.pop()]
        cycle.append(cycle)
        del cycle
        _ = [[] for _ in range(100)]  # allocations: a collection frees the cycle

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        held = [captured(lambda: x * 3, pool)[0]]
        alive = weakref.ref(held[0])
        drop_in_a_cycle(held)
        assert alive() is None  # the premise: such a cycle is collected there and then
        held = [captured(lambda: x * 3, pool)[0]]
        alive = weakref.ref(held[0])
        runs = []

        def run():
            runs.append(None)
            if len(runs) == 2:  # in the capture, not in the eager run before it
                drop_in_a_cycle(held)
            return x * 2

        graph, out = captured(run, pool)
    finally:
        gc.set_threshold(*thresholds)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    gc.collect()
    assert alive() is None
