"""The newcomer's path of the README's first screen, with real processes: `preload start
MODEL` (the checkpoint as a positional argument, as `vllm serve MODEL` takes it) returns
once one worker answers, and says where on stdout: `serving http://127.0.0.1:PORT/v1
(1 worker)`; a completion sent to that URL is answered. `--workers 0` holds the weights
only, says so, and leaves the API port unanswered. `--model` alone still names the
checkpoint; MODEL and a different --model together are a usage error (exit 2) naming both,
before anything starts. Every daemon started here is stopped (`preload stop`, then
whatever survived killed) on the way out.
"""

from __future__ import annotations

import re
import socket
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from daemons import daemon_processes, free_port, port_is_free, preload, sockets_in, stop_everything

START_TIMEOUT = 180  # seconds: imports (~3-6 s), the load, a worker's start; more on a loaded 2-core machine
CPU = ("--device", "cpu", "--dtype", "float32")


@contextmanager
def started(state_dir: Path, *args):
    """`preload start ARGS --state-dir ... --health-port FREE` (the command's own defaults
    otherwise: one worker), its CompletedProcess; stopped on the way out with `preload
    stop`, and anything that survived that killed."""
    args = (*args, "--state-dir", state_dir, "--health-port", free_port())
    try:
        r = preload("start", *args, timeout=START_TIMEOUT)
        yield r
    finally:
        stopped = preload("stop", "--state-dir", state_dir, timeout=60)
        stop_everything(state_dir)
        assert stopped.returncode == 0, stopped.stderr
        assert daemon_processes(state_dir) == []


def log_of(state_dir: Path) -> str:
    out = []
    for path in sorted(state_dir.glob("*.log")):
        out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def answers(port: int) -> bool:
    """Whether anything accepts a TCP connection on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_start_model_serves_with_one_worker_by_default_and_prints_its_url(tiny_checkpoint, tmp_path):
    state_dir, port = tmp_path / "state", free_port()
    with started(state_dir, tiny_checkpoint, *CPU, "--port", port) as r:
        assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{log_of(state_dir)}"
        url = f"http://127.0.0.1:{port}/v1"
        [line] = [ln for ln in r.stdout.splitlines() if "serving" in ln]
        assert f"serving {url} (1 worker)" in line, r.stdout
        assert re.search(r"preload daemon ready \(pid \d+\)", line), line
        # The URL printed is the one to use: /v1/completions under it answers at once.
        body = {"prompt": "t5 t6 t7", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        c = httpx.post(url + "/completions", json=body, timeout=60)
        assert c.status_code == 200, c.text
        out = c.json()
        assert out["model"] == tiny_checkpoint.name and out["usage"]["completion_tokens"] == 4
        models = httpx.get(url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [tiny_checkpoint.name]
        # What the daemon holds is the positional MODEL, and it supervises one worker.
        status = preload("status", "--state-dir", state_dir, "--json")
        assert status.returncode == 0, status.stderr
        assert str(tiny_checkpoint) in status.stdout and f'"port": {port}' in status.stdout
    assert port_is_free(port)  # stopped: the API port is let go
    assert sockets_in(state_dir) == []


def test_workers_0_holds_the_weights_only_and_the_api_port_does_not_answer(tiny_checkpoint, tmp_path):
    """Also the --model spelling alone: it names the checkpoint as MODEL does."""
    state_dir, port = tmp_path / "state", free_port()
    with started(state_dir, "--model", tiny_checkpoint, *CPU, "--workers", 0, "--port", port) as r:
        assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{log_of(state_dir)}"
        assert "holding the weights only (--workers 0)" in r.stdout, r.stdout
        assert "serving http" not in r.stdout
        assert not answers(port), f"something answers on the API port {port} with --workers 0"
        status = preload("status", "--state-dir", state_dir)
        assert status.returncode == 0 and "ready" in status.stdout and str(tiny_checkpoint) in status.stdout, \
            status.stdout + status.stderr


@pytest.mark.parametrize("order", ["positional-first", "option-first"])
def test_model_and_a_different_model_option_are_a_usage_error_naming_both(tiny_checkpoint, tmp_path, order):
    other = tmp_path / "other-model"
    other.mkdir()
    state_dir, port = tmp_path / "state", free_port()
    args = (tiny_checkpoint, "--model", other) if order == "positional-first" else ("--model", other, tiny_checkpoint)
    try:
        r = preload("start", *args, *CPU, "--state-dir", state_dir, "--port", port, "--health-port", free_port())
        assert r.returncode == 2, f"{r.returncode}: {r.stdout}{r.stderr}"
        assert str(tiny_checkpoint) in r.stderr and str(other) in r.stderr, r.stderr
        assert "Usage:" in r.stderr  # click's usage error, not a failed start
        # Refused before anything started or was written.
        assert not state_dir.exists()
        assert daemon_processes(state_dir) == []
        assert port_is_free(port)
    finally:
        stop_everything(state_dir)
