"""Dropped streams through a real daemon (issue 36): 500 streaming completions on one
supervised worker (the bundled model on the CPU, the defaults: --max-num-seqs 256, so 256
decode and 244 wait), every connection closed at once; the worker's KV blocks and its
running and waiting requests all come back (the daemon's /metrics, which the front
publishes from its core's beats), and the worker serves on.

How soon is a figure, not a test's business: scripts/probe_aborts.py measures it (issue
36: 0.5-2.2 s before the fix, 0.13-0.66 s after, results/aborts/). What makes it fast is
held deterministically in test_front.py (one abort message for all, the beat at once, the
core's threads).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from daemons import running_daemon
from probe_aborts import drop_streams, gauges, idle

from preload import BUNDLED_MODEL
from preload.bench.driver import free_port

STREAMS = 500


def test_five_hundred_dropped_streams_free_everything_they_held(tmp_path):
    api_port = free_port()
    with running_daemon(tmp_path / "state", Path(BUNDLED_MODEL), "--device", "cpu", "--workers", "1",
                        "--port", api_port, quant="none") as d:
        got = drop_streams(d.port, api_port, STREAMS, timeout=30)
        assert got["freed"], got
        assert got["running"] == 256 and got["waiting"] == STREAMS - 256, got
        assert idle(gauges(d.port))
        r = httpx.post(f"http://127.0.0.1:{api_port}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
