"""`preload serve --model DIR` where no daemon runs: the worker loads the checkpoint itself
and serves (as vLLM's preload falls back), and says so where an operator looks, its log
and /status; `--require-daemon` refuses to start instead. With a daemon, /status says the
weights are the daemon's."""

from __future__ import annotations

import subprocess

import pytest
from daemons import PRELOAD, free_port
from workers import one_worker, spawn_worker, stop_worker, wait_healthy


def test_with_no_daemon_the_worker_loads_the_checkpoint_itself_and_says_so(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"  # no daemon has ever run here
    worker = spawn_worker(state_dir, tmp_path / "worker.log", "--model", tiny_checkpoint)
    try:
        wait_healthy(worker)
        status = worker.get("/status").json()
        assert status["status"] == "ready" and status["weights"] == "in-process"
        assert "no daemon" in status["weights_note"] and "--require-daemon" in status["weights_note"]
        assert "no daemon" in worker.log_text() and "WARNING" in worker.log_text()
        r = worker.post("/v1/completions", {"model": tiny_checkpoint.name, "prompt": [5, 6, 7], "max_tokens": 4,
                                            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert stop_worker(worker) == 0


def test_require_daemon_refuses_to_start_without_one(tiny_checkpoint, tmp_path):
    port = free_port()
    r = subprocess.run([PRELOAD, "serve", "--state-dir", tmp_path / "state", "--port", str(port), "--model",
                        tiny_checkpoint, "--require-daemon"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "no preload daemon is running" in r.stderr


def test_without_a_model_there_is_nothing_to_fall_back_to(tmp_path):
    r = subprocess.run([PRELOAD, "serve", "--state-dir", tmp_path / "state", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no preload daemon is running" in r.stderr


@pytest.fixture(scope="module")
def attached(tiny_checkpoint, tmp_path_factory):
    with one_worker(tiny_checkpoint, tmp_path_factory, "fallback-attached") as worker:
        yield worker


def test_an_attached_worker_says_its_weights_are_the_daemons(attached):
    status = attached.get("/status").json()
    assert status["status"] == "ready" and status["weights"] == "attached"
    assert status["weights_note"].startswith("the daemon's on ")
