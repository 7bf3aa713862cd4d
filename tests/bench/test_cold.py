"""`preload bench cold` with workers says where the first worker's start went: the lines
of its log that time it (weights attached, first step, KV cache, ready), from a real
`preload start --workers 1`, kept in the JSON and printed under the table."""

from __future__ import annotations

from preload import BUNDLED_MODEL
from preload.bench import cold


def test_a_start_with_a_worker_keeps_the_lines_that_time_its_start():
    run = cold.run_start(BUNDLED_MODEL, "none", "cpu", workers=1)
    found = {phrase: [line for line in run.worker_log if phrase in line] for phrase in cold.WORKER_START}
    for phrase in ("weights attached in", "first step", "KV cache", "ready in"):  # (graphs are captured on a GPU only)
        assert len(found[phrase]) == 1, (phrase, run.worker_log)
    assert run.start_to_ready_s > 0 and run.load_seconds > 0

    summary = cold.summarize_starts([run], warm_s=1.0, first_s=1.0)
    assert summary["worker_log"] == run.worker_log
