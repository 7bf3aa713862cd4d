"""Running real `preload serve` workers from tests, beside a daemon from `daemons.py`.

A worker is a subprocess whose output goes to a log file (so a full pipe never blocks
it); `running_worker` waits for its /health to say 200 and always stops it on the way
out: SIGTERM (the worker drains and exits), then SIGKILL if it lingers.

`chat_model` picks the checkpoint the server tests run on: the bundled model when it
has been trained, else a copy of the tiny random checkpoint with a chat template.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from daemons import PRELOAD, free_port, metrics, running_daemon

from preload import BUNDLED_MODEL

FIRST_ID = 5  # token ids below this may be special tokens (bos, eos, chat roles) in the bundled model
SERVE_TIMEOUT = 120  # seconds to /health 200; a start costs an `import torch` (~3-6 s), more when loaded

# For the tiny word-level tokenizer ("t0".."t96"): every piece of the rendering is a token.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}t2 {% elif m['role'] == 'user' %}t3 {% else %}t4 {% endif %}"
    "{{ m['content'] }} t1 {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)


def bundled_model_ready() -> bool:
    return (Path(BUNDLED_MODEL) / "model.safetensors").exists()


def chat_model(target: Path, make_tiny: Callable[[], Path]) -> Path:
    """The bundled model if trained; else the tiny checkpoint copied to `target` (its
    name becomes the served model id) with a tokenizer_config.json holding a chat template."""
    if bundled_model_ready():
        return Path(BUNDLED_MODEL)
    shutil.copytree(make_tiny(), target)
    (target / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t0", "eos_token": "t1", "chat_template": TINY_CHAT_TEMPLATE})
    )
    return target


@dataclass
class Worker:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=kw.pop("timeout", 60), **kw)

    def metrics(self) -> dict[str, float]:
        r = self.get("/metrics")
        r.raise_for_status()
        return metrics(r.text)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def spawn_worker(state_dir: Path, log: Path, *extra, port: int | None = None) -> Worker:
    """`preload serve` as a subprocess; returns at once (not yet healthy)."""
    port = port or free_port()
    # Idle OpenMP threads sleep instead of spinning: on a loaded 2-core machine spinning
    # made every engine step 10-70x slower (performance only; outputs are the same).
    env = {"OMP_WAIT_POLICY": "PASSIVE"} | os.environ
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [PRELOAD, "serve", "--state-dir", str(state_dir), "--port", str(port), *map(str, extra)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    return Worker(proc, port, log)


def wait_healthy(worker: Worker, timeout: float = SERVE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise AssertionError(f"preload serve exited with {worker.proc.returncode}:\n{worker.log_text()}")
        try:
            if httpx.get(worker.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"preload serve not healthy within {timeout} s:\n{worker.log_text()}")


def stop_worker(worker: Worker, timeout: float = 30) -> int | None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`; returns its exit status."""
    proc = worker.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@contextmanager
def running_workers(state_dir: Path, log_dir: Path, *option_sets: tuple):
    """Several workers on one daemon, started together (their `import torch`es
    overlap), each with its own options; yields them once all are healthy."""
    with ExitStack() as stack:
        workers = []
        for i, options in enumerate(option_sets):
            w = spawn_worker(state_dir, log_dir / f"worker{i}.log", *options)
            stack.callback(stop_worker, w)
            workers.append(w)
        for w in workers:
            wait_healthy(w)
        yield workers


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    out = []
    for event in events:
        lines = [ln for ln in event.split("\n") if ln.startswith("data:")]
        assert lines, f"SSE event without data: {event!r}"
        out.append("\n".join(ln[5:].lstrip(" ") for ln in lines))
    return out


@contextmanager
def one_worker(model: Path, tmp_path_factory, name: str, *options: str):
    """A daemon holding `model` in float32 and one worker attached to it (`preload serve`
    with `options`), under temp dirs named `name`; stopped on the way out."""
    with running_daemon(tmp_path_factory.mktemp(name) / "state", model, "--dtype", "float32") as d, \
            running_workers(d.state_dir, tmp_path_factory.mktemp("logs"), options) as (w,):
        yield w


# ---- requests and their answers ---------------------------------------------------------------


def ids(n: int, seed: int, vocab: int) -> list[int]:
    """`n` random token ids, none of them special."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def greedy(prompt, max_tokens: int = 8, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(r: httpx.Response) -> list[dict]:
    """The JSON chunks of a completed SSE response; asserts it ends with [DONE] (once)."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data and data[-1] == "[DONE]", data[-3:]
    assert data.count("[DONE]") == 1
    return [json.loads(d) for d in data[:-1]]


def joined(chunks: list[dict], n: int = 1) -> tuple[list[str], list[str | None]]:
    """Per-choice concatenated text and finish_reason of completion chunks."""
    texts, reasons = [""] * n, [None] * n
    for c in chunks:
        for ch in c["choices"]:
            i = ch["index"]
            texts[i] += ch["text"]
            if ch["finish_reason"] is not None:
                assert reasons[i] is None, f"choice {i} finished twice"
                reasons[i] = ch["finish_reason"]
    return texts, reasons
