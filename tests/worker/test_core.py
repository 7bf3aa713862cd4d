"""An engine core (worker/core.py) while idle captures the graphs a lazy start left back to
back, looking for requests between captures without waiting on its socket: a fresh
worker's buckets are all captured within their own time (a few seconds on the H200), not a
beat's wait (0.25 s) apart, so that the first requests after it, or a load test waiting for
them (bench serve), do not find them still pending a minute on."""

from __future__ import annotations

import threading
import time

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.core import Core, hello_of
from preload.worker.core_channel import BEAT


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
