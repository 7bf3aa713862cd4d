"""Keep-alive clients across a worker kill: how soon the replacement serves keep-alive
clients again, and whether the connections' closes (Connection: close from
worker/api/app.py) come spread out or in a herd.

A daemon with 2 workers, N clients each on its own keep-alive connection (httpx, one
connection per client) sending short completions without pause; slot 0's worker is
SIGKILLed, and /metrics (requests served per slot) and /status (the replacement's
readiness) are polled every 50 ms. Prints one JSON line per kill:

    .venv/bin/python scripts/keepalive_rebalance.py [--model DIR] [--kills 3] [--clients 8]

kill_to_ready_s: the kill to the replacement's ready in /status; kill_to_first_served_s:
the kill to the first request the replacement answered (the 5 s goal of issue 13);
closes_max_per_100ms: the most Connection: close answers within any 100 ms (a herd
would be every client at once); share_after: the replacement's share of the requests
from its first answer to the end of the window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from preload.bench.driver import free_port, start_daemon, wait_for

PROMPT = "t5 t6 t7"


def served(port: int) -> dict[str, float]:
    """Completions answered 200, per worker slot (the workers' counters, dead ones included)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("preload_http_requests_total{") and 'route="/v1/completions"' in line \
                and 'status="200"' in line:
            key, value = line.rsplit(" ", 1)
            slot = key.split('worker="', 1)[1].split('"', 1)[0]
            out[slot] = out.get(slot, 0.0) + float(value)
    return out


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def one_kill(d, clients: int, window: float) -> dict:
    stop = threading.Event()
    closes: list[float] = []  # when a response said Connection: close
    errors: list[str] = []
    killed_at = [time.monotonic()]

    def client() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        with httpx.Client(base_url=f"http://127.0.0.1:{d.api_port}", timeout=60, limits=limits) as c:
            while not stop.is_set():
                try:
                    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
                    if r.headers.get("connection", "").lower() == "close":
                        closes.append(time.monotonic())
                except httpx.HTTPError as e:  # the killed worker's connections break
                    errors.append(f"{time.monotonic() - killed_at[0]:+.2f} s {type(e).__name__}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)  # every client connected and served
        old = {w["slot"]: w["pid"] for w in d.workers()}
        killed = killed_at[0] = time.monotonic()
        os.kill(old[0], signal.SIGKILL)
        wait_for(lambda: dead(old[0]), timeout=10, interval=0.005)
        base = served(d.port)
        ready = first = None
        samples = []
        while time.monotonic() - killed < window:
            now = time.monotonic()
            s = served(d.port)
            samples.append((now, s))
            if first is None and s.get("0", 0) > base.get("0", 0):
                first = now - killed
            if ready is None:
                w0 = {w["slot"]: w for w in d.workers()}[0]
                if w0["pid"] not in (None, old[0]) and w0["state"] == "ready":
                    ready = now - killed
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    after = [s for t, s in samples if first is not None and t - killed >= first]
    share = None
    if len(after) >= 2:
        d0 = after[-1].get("0", 0) - after[0].get("0", 0)
        d1 = after[-1].get("1", 0) - after[0].get("1", 0)
        share = round(d0 / (d0 + d1), 3) if d0 + d1 else None
    closes = sorted(c - killed for c in closes)
    herd = max((sum(1 for c in closes if a <= c < a + 0.1) for a in closes), default=0)
    return {"kill_to_ready_s": ready and round(ready, 2), "kill_to_first_served_s": first and round(first, 2),
            "closes_max_per_100ms": herd, "closes_per_s": round(len(closes) / (window + 3), 2),
            "share_after": share, "errors": sorted(set(errors)), "failed": len(errors)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a checkpoint dir (default: the bundled model)")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--window", type=float, default=10.0, help="seconds watched after each kill")
    a = p.parse_args()
    state_dir = Path(tempfile.mkdtemp(prefix="preload-keepalive-"))
    d = start_daemon(state_dir / "state", a.model, "--workers", 2, "--dtype", "float32", api_port=free_port())
    try:
        for _ in range(a.kills):
            wait_for(lambda: all(w["state"] == "ready" and w["pid"] for w in d.workers()), timeout=60)
            print(json.dumps(one_kill(d, a.clients, a.window)), flush=True)
    finally:
        d.stop(timeout=15)


if __name__ == "__main__":
    main()
