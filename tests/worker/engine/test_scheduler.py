"""The scheduler's choices, without a model: which sequences a step computes and how many
tokens each (a test step does what the engine does: advance `computed`, and append a
token once a sequence's pending tokens are all in)."""

from __future__ import annotations

from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.scheduler import Scheduler
from preload.worker.engine.sequence import Sequence


def seq(n: int, max_tokens: int = 100) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> list[tuple[Sequence, int]]:
    batch = s.schedule()
    for q, n in batch:
        q.computed += n
        if q.pending == 0:
            q.output.append(7)
    return batch


def test_at_most_max_num_active_seqs_a_step_and_the_admitted_take_turns():
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=6, max_num_batched_tokens=4096, max_num_active_seqs=2)
    seqs = [seq(10) for _ in range(6)]
    for q in seqs:
        s.add(q)
    batch = step(s)
    assert len(batch) == 2 and len(s.running) == 2  # two places a step
    for _ in range(4):  # the admitted take one place, admissions the other: all six in after five steps
        batch = step(s)
        assert len(batch) == 2 and sum(q.computed > 10 for q, _ in batch) == 1
    assert len(s.running) == 6 and not s.waiting
    counts = {q.id: 0 for q in seqs}
    for _ in range(9):  # decoding: each admitted sequence computed once every three steps
        for q, n in step(s):
            assert n == 1
            counts[q.id] += 1
    assert set(counts.values()) == {3}, counts


def test_without_the_active_bound_every_admitted_sequence_runs_each_step():
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=6, max_num_batched_tokens=4096)
    for _ in range(6):
        s.add(seq(10))
    assert len(step(s)) == 6 and len(step(s)) == 6


def test_a_long_prefill_threshold_lets_short_requests_in_the_first_step():
    def first_step(threshold: int) -> list[tuple[Sequence, int]]:
        s = Scheduler(BlockManager(2000, 16), max_num_seqs=16, max_num_batched_tokens=512,
                      long_prefill_token_threshold=threshold)
        for q in [seq(1000) for _ in range(4)] + [seq(20) for _ in range(4)]:
            s.add(q)
        return step(s)

    without = first_step(0)
    assert [n for _, n in without] == [512]  # one long prompt takes the whole budget
    with_cap = first_step(256)
    chunks = [n for _, n in with_cap]
    # 8 prefills waiting: each long one gets 256 // 8 (the block size at least)...
    assert chunks[:4] == [32] * 4
    assert chunks[4:] == [20] * 4  # ...and the short ones come in whole, in the same step
    assert sum(chunks) <= 512


def test_long_chunks_grow_as_the_waiting_prefills_drain():
    """The cap is the threshold divided among the prefills waiting as a step begins: four,
    a quarter; two, a half; none, all of it."""
    s = Scheduler(BlockManager(2000, 16), max_num_seqs=2, max_num_batched_tokens=4096,
                  long_prefill_token_threshold=256)
    a, b, c, d = (seq(600) for _ in range(4))
    for q in (a, b, c, d):
        s.add(q)
    assert step(s) == [(a, 64), (b, 64)]  # four waiting; two admitted (--max-num-seqs 2)
    assert step(s) == [(a, 128), (b, 128)]  # c and d still wait
    for q in (a, b):
        s.finish(q, "length")
    assert step(s) == [(c, 128), (d, 128)]  # admitted while both still counted as waiting
    assert step(s) == [(c, 256), (d, 256)]  # nobody waits: the whole threshold


def test_a_preempted_sequence_goes_before_new_arrivals():
    blocks = BlockManager(8, 4)  # 32 slots
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(12, max_tokens=50), seq(12, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)  # both admitted: 3 + 3 blocks
    late = seq(4)
    s.add(late)
    for _ in range(12):  # decoding grows them until the cache is full: b, the newer, is preempted
        step(s)
        if s.preemptions:
            break
    assert s.preemptions == 1 and s.waiting[0] is b and s.waiting[1] is late
    assert b.computed == 0 and b.blocks == [] and len(b.output) > 0  # recomputed, output kept
    s.finish(a, "abort")  # room again: b comes back before the new arrival
    batch = step(s)
    assert batch[0][0] is b
