"""The benchmarks' figures on the GPU, where they are measured: a decode step carries the
whole batch and reads no more than the HBM can deliver in its time (the byte count is
what the step must read, so the % cannot pass 100); its profile counts each step the GPU ran
once; a prefill step's breakdown by
operation adds up to its time on the GPU's timeline and names the prefill's own
operations. (The GPU's busy time comes from other runs, under the profiler, which
lengthens small kernels: on a 5 ms step it came out above the events' span.)

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

from pathlib import Path

import pytest

from preload.bench.decode import run_decode
from preload.bench.prefill import Case, run_prefill
from preload.options import BUNDLED_MODEL

pytestmark = pytest.mark.gpu


def test_a_decode_run_stays_within_the_bandwidth():
    result = run_decode(Path(BUNDLED_MODEL), "cuda", ["none"], [(16, 2048), (64, 256)], 16, False, lambda msg: None)
    for r in result["runs"]:
        assert r["tokens_per_step"] == r["batch"], r
        assert 0 < r["hbm_percent"] <= 100, r


def test_a_decode_profile_counts_each_step_the_gpu_ran():
    # (Steps launched ahead: the last call's step runs inside the profiled window; counted as
    # 5 where the GPU ran 6, every kernel showed 1.2 times a step and 20% more time.)
    result = run_decode(Path(BUNDLED_MODEL), "cuda", ["none"], [(16, 256)], 16, False, lambda msg: None, profile=True)
    (p,) = result["profiles"]
    sampled = [k for k in p["top"] if "ArgMax" in k["kernel"]]  # (greedy draws: one argmax a step)
    assert sampled and all(k["calls_per_step"] == 1.0 for k in sampled), p["top"]


def test_a_prefill_steps_operations_add_up_to_its_time():
    result = run_prefill(None, "v2-lite-mini", "cuda", ["none"], [Case.parse("512x2c256+8@300")], [], 2048, 3,
                         lambda msg: None)
    (r,) = result["runs"]
    spans = {b["operation"]: b["ms"] for b in r["breakdown"]}
    assert sum(spans.values()) == pytest.approx(r["gpu_span_ms"], rel=1e-3)
    assert 0 < r["gpu_busy_ms"] and 0 < r["gpu_span_ms"]
    for op in ("routed experts: grouped GEMMs", "attention: prompt, flash", "attention: decode rows", "dense projections"):
        assert spans.get(op, 0) > 0, (op, spans)


def test_a_served_steps_timeline_accounts_for_its_wall_time():
    """The step as served, read off the GPU's timeline: the host's time to the first kernel,
    the device's busy time, the gaps between and the time after the last add up to the
    run's wall time; the device did some work, and no more than the wall time holds."""
    result = run_prefill(None, "v2-lite-mini", "cuda", ["none"], [Case.parse("512x2")], [], 2048, 3, lambda msg: None)
    (r,) = result["runs"]
    t = r["timeline"]
    assert t["activities"] > 10 and 0 < t["busy_ms"] <= t["wall_ms"]
    parts = t["to_first_ms"] + t["busy_ms"] + t["idle_ms"] + t["after_last_ms"]
    assert parts == pytest.approx(t["wall_ms"], rel=1e-6)
    assert all(g["us"] > 0 for g in t["gaps"]) and [g["us"] for g in t["gaps"]] == sorted(
        (g["us"] for g in t["gaps"]), reverse=True)
    # queued behind the step before, the host's preparation overlaps the GPU: never slower (10% for noise)
    assert 0 < r["queued_ms"] <= 1.1 * r["ms"], r
