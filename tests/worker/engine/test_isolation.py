"""One request can never take down the others: whatever fails in a sequence's own work
(sampling, logprobs in the engine; detokenizing, stop strings where its Outputs become
text) ends that sequence with an error naming the stage, while the sequence beside it in
the same batch gets exactly what it gets alone.
Faults of the engine itself (the forward, a CUDA error, out of memory) stop the engine,
and every request hears so."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_steps import run_to_end

from preload import BUNDLED_MODEL, LLM
from preload.worker.engine import engine as engine_module
from preload.worker.engine.async_engine import AsyncEngine, EngineDead, RequestFailed
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText, with_text
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence

PROMPT, OTHER = [5, 6, 7, 8], [9, 10, 11]


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32")


def run(engine, seqs: list[Sequence]) -> dict[int, Output]:
    """Drive the engine until `seqs` are done; each sequence's merged Output."""
    return run_to_end(engine, seqs)


def greedy(prompt, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def boom(*_, **__):
    raise RuntimeError("boom")


def fail_sampling(monkeypatch, is_victim) -> None:
    """Sampling fails for the batch holding the victim's row, and for that row alone."""
    real_batch, real_row = engine_module.sample_batch, engine_module.sample
    monkeypatch.setattr(engine_module, "sample_batch",
                        lambda l, ps, g, gen: boom() if any(map(is_victim, ps)) else real_batch(l, ps, g, gen))
    monkeypatch.setattr(engine_module, "sample", lambda l, p, g, gen: boom() if is_victim(p) else real_row(l, p, g, gen))


def fail_in(stage: str, victim: Sequence, text: OutputText, monkeypatch) -> None:
    """Make `stage` of the victim's own work raise: in the engine (sampling), or where its
    Outputs become text (the reader's side, output_text.py)."""
    if stage == "sampling":
        fail_sampling(monkeypatch, lambda p: p is victim.params)
    elif stage == "detokenizing":
        text.detokenizer.add = boom
    elif stage == "stop strings":
        text.stop_strings.release = boom


@pytest.mark.parametrize("stage", ["sampling", "detokenizing", "stop strings"])
def test_a_failing_sequence_ends_alone(llm, monkeypatch, stage):
    engine = llm.engine
    [alone] = run(engine, [greedy(OTHER)]).values()
    victim, bystander = greedy(PROMPT, seed=1), greedy(OTHER)
    texts = {seq.id: (seq, OutputText(engine.tokenizer, seq.params)) for seq in (victim, bystander)}
    for seq in (victim, bystander):
        engine.check(seq)
        engine.add(seq)
    fail_in(stage, victim, texts[victim.id][1], monkeypatch)
    outputs: dict[int, list[Output]] = {victim.id: [], bystander.id: []}
    while engine.has_work():
        for out in with_text(engine, texts, engine.step()):
            outputs[out.seq_id].append(out)
    failed, served = Output.merge(outputs[victim.id]), Output.merge(outputs[bystander.id])
    assert failed.error == f"{stage} failed for this request: RuntimeError: boom"
    assert victim.finished and not victim.blocks
    assert served.error is None and served.token_ids == alone.token_ids and served.text == alone.text
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0


@pytest.mark.parametrize("fault", [torch.OutOfMemoryError("out of memory"), torch.AcceleratorError("CUDA error"),
                                   MemoryError()])
def test_out_of_memory_and_cuda_errors_are_the_engines(llm, monkeypatch, fault):
    def raise_fault(*_):
        raise fault

    monkeypatch.setattr(engine_module, "sample_batch", raise_fault)
    monkeypatch.setattr(engine_module, "sample", raise_fault)
    seq = greedy(PROMPT)
    llm.engine.check(seq)
    llm.engine.add(seq)
    with pytest.raises(type(fault)):
        while llm.engine.has_work():
            llm.engine.step()
    llm.engine.abort(seq)


def test_a_tiny_temperature_is_greedy(llm):
    greedy_out = llm.generate([PROMPT], max_tokens=12, temperature=0, ignore_eos=True)[0]
    for tiny in (1e-45, 5e-324, 9.9e-6):
        out = llm.generate([PROMPT], max_tokens=12, temperature=tiny, ignore_eos=True)[0]
        assert out.token_ids == greedy_out.token_ids and out.text == greedy_out.text


async def read_all(engine: AsyncEngine, seq: Sequence) -> Output:
    return Output.merge([out async for out in engine.submit(seq)])


def test_async_engine_reports_a_sequence_fault_to_its_request_alone(llm, monkeypatch):
    [alone] = run(llm.engine, [greedy(OTHER, 16)]).values()
    fail_sampling(monkeypatch, lambda p: p.seed == 1)
    fatal = []

    async def main():
        engine = AsyncEngine(llm.engine, on_fatal=lambda: fatal.append(True))
        engine.start(asyncio.get_running_loop())
        try:
            results = await asyncio.gather(read_all(engine, greedy(PROMPT, 16, seed=1)), read_all(engine, greedy(OTHER, 16)),
                                           return_exceptions=True)
            return results, engine.alive, engine.stats()
        finally:
            engine.stop()

    (failed, served), alive, stats = asyncio.run(main())
    assert isinstance(failed, RequestFailed) and "sampling failed" in str(failed)
    assert served.token_ids == alone.token_ids
    assert alive and not fatal and stats.kv_blocks_used == 0


def test_a_failing_forward_stops_the_engine_and_every_request_hears(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.model, "forward", boom)
    fatal = []

    async def main():
        engine = AsyncEngine(llm.engine, on_fatal=lambda: fatal.append(True))
        engine.start(asyncio.get_running_loop())
        try:
            results = await asyncio.gather(read_all(engine, greedy(PROMPT)), read_all(engine, greedy(OTHER)),
                                           return_exceptions=True)
            return results, engine.alive
        finally:
            engine.stop()

    results, alive = asyncio.run(main())
    assert all(isinstance(r, EngineDead) for r in results), results
    assert not alive and fatal == [True]
    for seq in list(llm.engine.scheduler.running) + list(llm.engine.scheduler.waiting):
        llm.engine.abort(seq)  # leave the module's engine clean for the next test
