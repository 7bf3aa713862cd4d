"""An engine core (worker/core.py) while idle captures the graphs a lazy start left back to
back, looking for requests between captures without waiting on its socket: a fresh
worker's buckets are all captured within their own time (a few seconds on the H200), not a
beat's wait (0.25 s) apart, so that the first requests after it, or a load test waiting for
them (bench serve), do not find them still pending a minute on."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.core import FIRST_STEPS, Core, hello_of
from preload.worker.core_channel import BEAT, output_from_wire, params_to_wire
from preload.worker.engine.grammar import GrammarsUnavailable
from preload.worker.engine.sampling_params import SamplingParams


def test_an_idle_core_captures_its_pending_graphs_back_to_back(tmp_path):
    llm = LLM(BUNDLED_MODEL, dtype="float32", device="cpu", engine=EngineOptions(kv_cache_memory=8 << 20))
    core = Core(llm, f"ipc://{tmp_path}/slot.sock", hello_of(llm, "tiny", "first"), drain_timeout=1.0)
    captures: list[float] = []

    def capture_idle() -> bool:  # ten buckets pending, then none (a CPU engine has no graphs of its own)
        if len(captures) == 10:
            return False
        captures.append(time.monotonic())
        return True

    core.engine.capture_idle = capture_idle
    runs = threading.Thread(target=core.run)
    runs.start()
    deadline = time.monotonic() + 10 * BEAT + 5
    while len(captures) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    core.retired = True
    runs.join(5)
    core.sock.close()
    assert len(captures) == 10 and not runs.is_alive()
    assert captures[-1] - captures[0] < 3 * BEAT  # (one poll's wait apart, they would take 9 beats: 2.25 s)


def test_a_core_logs_its_first_steps_and_how_long_after_the_first_request_each_began(tmp_path, caplog):
    """What a start leaves to its first requests (kernels met for the first time, a graph
    captured at first use, an idle capture under way when the request came) shows in the
    core's log: its first FIRST_STEPS steps, each with its kind and time, and when it began
    after the first request came; later steps are not logged."""
    llm = LLM(BUNDLED_MODEL, dtype="float32", device="cpu", engine=EngineOptions(kv_cache_memory=8 << 20))
    core = Core(llm, f"ipc://{tmp_path}/slot.sock", hello_of(llm, "tiny", "first"), drain_timeout=1.0)
    params = params_to_wire(SamplingParams(max_tokens=FIRST_STEPS + 3, ignore_eos=True))
    core._on_add({"t": "add", "id": 7, "prompt": list(range(1, 20)), "params": params, "output": []})
    with caplog.at_level(logging.INFO, logger="preload.worker"):
        for _ in range(FIRST_STEPS + 2):
            core._step()
    core.sock.close()
    steps = [r.getMessage() for r in caplog.records if "after the first request came" in r.getMessage()]
    assert [m.split(" (")[0] for m in steps] == [f"step {i}" for i in range(1, FIRST_STEPS + 1)], steps
    assert steps[0].startswith("step 1 (prompt) in ") and steps[1].startswith("step 2 (decode")


def test_a_request_the_engine_cannot_take_is_answered_not_dropped(tmp_path):
    """A well-formed request that the engine fails to take (before: read as a malformed
    message and dropped, its client waiting for good) is answered with the reason: a
    RequestError as the request's refusal, anything else as a server error; the core goes
    on. A fault of the process or the device still stops it."""
    llm = LLM(BUNDLED_MODEL, dtype="float32", device="cpu", engine=EngineOptions(kv_cache_memory=8 << 20))
    core = Core(llm, f"ipc://{tmp_path}/slot.sock", hello_of(llm, "tiny", "first"), drain_timeout=1.0)
    sent: list[dict] = []
    core._send = sent.append
    params = params_to_wire(SamplingParams(max_tokens=2, ignore_eos=True))

    def add_failing(error: Exception):
        def add(seq):
            raise error
        return add

    try:
        for i, error in enumerate([GrammarsUnavailable("llguidance cannot read its tokenizer"), ValueError("odd")]):
            core.engine.add = add_failing(error)
            core._on_add({"t": "add", "id": 70 + i, "prompt": [1, 2, 3], "params": params, "output": []})
        core.engine.add = add_failing(torch.OutOfMemoryError("device memory"))
        with pytest.raises(torch.OutOfMemoryError):
            core._on_add({"t": "add", "id": 72, "prompt": [1, 2, 3], "params": params, "output": []})
    finally:
        core.sock.close()
    answers = [output_from_wire(o) for msg in sent for o in msg["o"]]
    assert [(a.seq_id, a.refused, a.finished) for a in answers] == [(70, True, True), (71, False, True)]
    assert "llguidance cannot read its tokenizer" in answers[0].error
    assert "ValueError: odd" in answers[1].error
    assert not core.seqs
