"""`preload demo`: the product in one minute on the bundled model.

Start the daemon with one worker, ask for a completion, kill the worker, and time
how long until the API answers again, with the same answer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request

import click

from preload.bench.driver import free_port, http_get, preload

DEFAULT_PROMPT = "def fibonacci(n):\n"


def complete(port: int, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


@click.command()
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="Text to complete.")
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(1, 1024))
@click.option("--device", default="auto", show_default=True, help="auto (the GPU when there is one), cpu or cuda:N.")
def demo(prompt: str, max_tokens: int, device: str) -> None:
    """Start a daemon + worker on the bundled model, kill the worker, watch it come back."""
    state_dir = tempfile.mkdtemp(prefix="preload-demo-")
    port = free_port()
    t0 = time.perf_counter()
    started = preload("start", "--state-dir", state_dir, "--device", device, "--workers", "1", "--port", str(port),
                      "--health-port", str(free_port()))
    if started.returncode:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise click.ClickException(started.stderr.strip() or "preload start failed")
    try:
        click.echo(f"1. daemon + 1 worker ready on port {port} in {time.perf_counter() - t0:.1f} s "
                   f"(cold start: imports, load, fork)")
        status = json.loads(preload("status", "--state-dir", state_dir, "--json").stdout)
        click.echo(f"   weights: {status['model']} ({status['dtype']}, {status['device']}), fingerprint {status['fingerprint'][:16]}...")
        first = complete(port, prompt, max_tokens)
        click.echo("2. prompt:")
        click.echo("   " + prompt.replace("\n", "\n   "))
        click.echo("   greedy completion:")
        click.echo("   " + first.replace("\n", "\n   "))

        pid = status["workers"][0]["pid"]
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:  # a connection made now waits in the daemon's backlog until a worker takes it
            try:
                code, _ = http_get(port, "/health", timeout=1.0)
            except OSError:
                code = None
            if code == 200:
                break
            time.sleep(0.005)
        healthy = time.perf_counter() - killed
        again = complete(port, prompt, max_tokens)
        answered = time.perf_counter() - killed
        click.echo(f"3. worker pid {pid} killed with SIGKILL: /health 200 again after {healthy:.3f} s, "
                   f"answered after {answered:.3f} s")
        click.echo(f"   same answer as before the kill: {'yes' if again == first else 'NO'}")
        if again != first:
            raise click.ClickException("the restarted worker answered differently")
    finally:
        stopped = preload("stop", "--state-dir", state_dir)
        click.echo(f"4. {stopped.stdout.strip() or stopped.stderr.strip()}")
        shutil.rmtree(state_dir, ignore_errors=True)
