"""`preload bench serve` against a real daemon's worker (the bundled model on the CPU):
every request completes with exactly the tokens asked for, and the run's engine steps
come from the worker's /metrics, scraped around it: a prompt step at least per request,
decode steps for the rest; none launched ahead on a CPU, so no wait on a GPU."""

from __future__ import annotations

import json

from daemons import running_daemon

from preload.bench.driver import free_port, preload


def test_a_run_reports_its_requests_and_the_engines_steps(tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", None, "--dtype", "float32", "--workers", 1, "--port", port):
        r = preload("bench", "serve", "--url", f"http://127.0.0.1:{port}", "--requests", 6, "--concurrency", 3,
                    "--prompt-len", "8:16", "--output-len", "4:8", "--vocab", 200, "--json", tmp_path / "serve.json",
                    timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    asked = sum(q["max_tokens"] for q in result["requests"])
    assert result["throughput"]["output_tokens"] == asked
    steps = result["engine_steps"]
    assert steps["prompt"]["steps"] >= 1 and steps["prompt"]["ms_per_step"] > 0
    # every token past each request's first comes from a decode step (several requests' at once)
    assert 1 <= steps["decode"]["steps"] <= asked - 6 and steps["decode"]["ms_per_step"] > 0
    assert steps["decode_ahead"]["steps"] == 0 and steps["gpu_wait_share"] is None
    assert "engine steps: prompt" in r.stdout
