"""`preload bench cold` (bench/cold.py, bench/start_run.py) with workers says where the first worker's start went: the lines
of the daemon's and worker 0's logs that time it (the zygote launched, the health port open,
loading, loaded (so that the load's end and the zygote's ready compare), the zygote's
imports done, worker started, weights attached, first step, KV cache, ready, its front
ready; on a GPU host whose cache held only the list, the zygote's kernels compiled ahead), from a real `preload start --workers 1`, in time order, kept in the JSON and printed
under the table; then its first request's: when the bench sent it, the core's first steps,
when it was answered. A first start (which fills the kernel cache the warm starts after it
use) is stopped only once its worker has nothing left to capture or compile while idle. A
first start on a cache that an image's build filled from that list is timed too."""

from __future__ import annotations

import json

import pytest

from preload import BUNDLED_MODEL
from preload.bench import cold, start_run


def test_a_start_with_a_worker_keeps_the_lines_that_time_its_start():
    run = start_run.run_start(BUNDLED_MODEL, "none", "cpu", workers=1, settled=True)
    phrases = [p for phrases in start_run.START_LINES.values() for p in phrases]
    found = {phrase: [line for line in run.worker_log if phrase in line] for phrase in phrases}
    for phrase in ("zygote launched", "health port", "loading ", "loaded in", "zygote ready", "worker 0 started",
                   "weights attached in", "first step", "KV cache", "worker 0 ready"):
        assert len(found[phrase]) == 1, (phrase, run.worker_log)  # (graphs are captured on a GPU only)
    assert len(found["ready in"]) == 3, run.worker_log  # the daemon's load, the worker, its front
    assert any("front-0" in line for line in found["ready in"]), run.worker_log
    assert run.worker_log == sorted(run.worker_log)
    order = [next(i for i, line in enumerate(run.worker_log) if p in line)
             for p in ("zygote launched", "health port", "loading ", "zygote ready", "worker 0 started",
                       "weights attached in", "worker 0 ready")]
    assert order == sorted(order), run.worker_log
    assert run.start_to_ready_s > 0 and run.load_seconds > 0
    assert 0 < run.first_request_s < 60, run.first_request_s  # (served: a failed request raises)
    # The first request's timeline: sent, the core's first step (worker/core.py), answered.
    timeline = [next(i for i, line in enumerate(run.worker_log) if p in line)
                for p in ("bench: the first request sent", "step 1 (prompt)", "bench: its answer received")]
    assert timeline == sorted(timeline), run.worker_log
    assert run.settled_s is not None and run.first_request_s <= run.settled_s < start_run.SETTLE_TIMEOUT, run.settled_s

    summary = cold.summarize_starts([run], warm_s=1.0, first_s=1.0)
    assert summary["worker_log"] == run.worker_log
    assert summary["first_request_s"]["p50"] == run.first_request_s


def test_a_first_start_on_a_list_compiled_as_an_image_build_compiles_it_without_a_gpu_first(tmp_path, monkeypatch):
    """The fresh host deploy/Dockerfile makes: `preload kernels compile` (no GPU visible) fills
    an empty cache from the list a first start recorded, timed apart, then the start."""
    pytest.importorskip("triton")
    from kernel_specs import CASES, rms_norm_spec

    from preload.kernels import ahead

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (compiled for real)
    recorded = tmp_path / "first-start"
    recorded.mkdir()
    specs = [rms_norm_spec(add, block)[0] for add, block in CASES]
    ahead.list_path(recorded).write_text(json.dumps({"kernels": {ahead.entry_digest(s): s for s in specs}}))
    run = cold.listed_start(BUNDLED_MODEL, "none", "cpu", 1, recorded, compiled=True)
    assert run["imaged"] and run["compile_s"] > 0
    assert f"compiled {len(specs)} of {len(specs)} kernels" in run["compile_said"], run["compile_said"]
    assert run["start_to_ready_s"] > 0 and 0 < run["first_request_s"] < 60
