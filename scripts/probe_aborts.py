"""Dropped streams: how soon a worker frees the KV cache of clients that hang up (issue 36).

A daemon (`preload start --workers 1`, the bundled model, CPU) gets N streaming
completions at once (long max_tokens, ignore_eos), each on its own connection (raw
sockets: a client library's own work for 500 streams would be what is measured); once
every response has begun and the worker's batch is full, every connection is closed at
once, and the daemon's /metrics (the worker's gauges, from its core's beats) is polled
until the KV blocks in use and the requests running and waiting are back to zero.
Prints one JSON line per round:

    .venv/bin/python scripts/probe_aborts.py [--streams 500] [--rounds 3] [--hold 0.3] [--keep] \
        [--model DIR] [-- START_OPTIONS...]

freed_s: from the last close to the first scrape that shows the blocks free (the gauges
come from the core's beats: a beat's lag is part of it); running/waiting/kv_blocks_used:
what the worker held at the drop; t_closed: the last close on the monotonic clock, which
the daemon's processes share (to find it in the logs of the state dir, printed first and
kept with --keep). tests/worker/test_dropped_streams.py runs `drop_streams`.

Issue 36 (2 CPUs, bundled model, defaults: --max-num-seqs 256, so 256 running and 244
waiting): 500 dropped streams were freed in 0.5-2.2 s (median ~0.8 s, 13 rounds); after
the fix (worker/core.py, worker/front.py) in 0.13-0.66 s (median ~0.25 s, 19 rounds), the
machine shared with other work throughout (load average 3-7).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from preload import BUNDLED_MODEL
from preload.bench.driver import free_port, http_get, start_daemon

PROMPT = "def main():\n    "


def gauges(port: int) -> dict[str, float]:
    """The worker's gauges (summed over workers) from the daemon's /metrics on `port`."""
    code, body = http_get(port, "/metrics")
    assert code == 200, code
    out = {"running": 0.0, "waiting": 0.0, "kv_blocks_used": 0.0}
    for line in body.decode().splitlines():
        for name in out:
            if line.startswith(f"preload_{'num_requests_' if name != 'kv_blocks_used' else ''}{name}{{"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def idle(g: dict[str, float]) -> bool:
    return g["running"] == 0 and g["waiting"] == 0 and g["kv_blocks_used"] == 0


async def open_stream(api_port: int, max_tokens: int, seed: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streaming completion on a connection of its own, once its response has begun
    (headers and a first event read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", api_port)
    body = json.dumps({"prompt": PROMPT + f"x{seed} = ", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stream {seed}: {head[:200]!r}")
    return reader, writer


async def drain(reader: asyncio.StreamReader) -> None:
    """Read the stream and throw it away (so that the server's writes never block)."""
    while await reader.read(1 << 16):
        pass


def drop_streams(port: int, api_port: int, n: int, max_tokens: int = 3000, running: int | None = None,
                 hold: float = 0.3, timeout: float = 60.0, interval: float = 0.01, on_drop=None) -> dict:
    """Open `n` streams on `api_port`, wait until the worker runs `running` of them (default:
    min(n, 256), --max-num-seqs' default) and holds the rest waiting, close them all at once,
    and poll the daemon's /metrics (health `port`) until the worker is idle. Returns the
    figures: freed_s (the last close to the first idle scrape) and what was held at the drop.
    `on_drop()`: called just before the connections close (a profiler started, say)."""
    want = min(n, 256) if running is None else running

    async def main() -> dict:
        conns = await asyncio.gather(*(open_stream(api_port, max_tokens, i) for i in range(n)))
        readers = [asyncio.ensure_future(drain(r)) for r, _ in conns]
        deadline = time.monotonic() + timeout
        while True:
            held = await asyncio.to_thread(gauges, port)
            if held["running"] >= want and held["running"] + held["waiting"] >= n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker never ran {want} of {n} streams: {held}")
            await asyncio.sleep(0.05)
        await asyncio.sleep(hold)  # (tokens flowing on every running stream)
        for t in readers:
            t.cancel()
        if on_drop is not None:
            on_drop()
        first = time.monotonic()
        for _, w in conns:
            w.close()
        closed = time.monotonic()
        return {"held": held, "first": first, "closed": closed}

    out = asyncio.run(main())
    deadline = out["closed"] + timeout
    g = gauges(port)
    scrapes = 1
    while not idle(g) and time.monotonic() < deadline:
        time.sleep(interval)
        g = gauges(port)
        scrapes += 1
    freed = time.monotonic()
    return {"streams": n, "running": out["held"]["running"], "waiting": out["held"]["waiting"],
            "kv_blocks_used": out["held"]["kv_blocks_used"], "close_s": round(out["closed"] - out["first"], 3),
            "freed_s": round(freed - out["closed"], 3), "freed": idle(g), "left": g, "scrapes": scrapes,
            "t_closed": round(out["closed"], 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(BUNDLED_MODEL))
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=3000)
    p.add_argument("--hold", type=float, default=0.3, help="seconds the streams run once the batch is full")
    p.add_argument("--keep", action="store_true", help="keep the state dir (the workers' logs)")
    p.add_argument("start", nargs="*", help="more `preload start` options (after --)")
    args = p.parse_args(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="preload-aborts-"))
    print(state_dir, flush=True)
    seqs = args.start[args.start.index("--max-num-seqs") + 1] if "--max-num-seqs" in args.start else 256
    api_port = free_port()
    d = start_daemon(state_dir, args.model, "--device", "cpu", "--workers", "1", *args.start, api_port=api_port)
    try:
        for r in range(args.rounds):
            got = drop_streams(d.port, api_port, args.streams, args.max_tokens, min(args.streams, int(seqs)), args.hold)
            print(json.dumps({"round": r, **got}), flush=True)
    finally:
        d.stop()
        if not args.keep:
            shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
