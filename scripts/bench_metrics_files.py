"""What a scrape of the workers' metrics dir costs with many dead workers' files, and
after the daemon absorbed them (ipc/metrics_files.py; issue 36: 676 files after 200
rolling restarts, a scrape 0.31 -> 0.60 s).

N forked processes each write the series a worker writes (worker/api/metrics.py's
WorkerMetrics, prometheus-client in its multiprocess mode: a counter, a histogram and a
livesum gauge file each; a few requests' worth of values) and exit. Then /metrics's
work (generate_latest over the Exposition) is timed over the dir as it is, then once the
dead are absorbed; the served sums are checked equal. Prints one JSON line:

    .venv/bin/python scripts/bench_metrics_files.py [--processes 200] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from preload.ipc.exposition import Exposition
from preload.ipc.metrics_files import MetricsDirCollector, absorb, owners
from preload.worker.api.metrics import MULTIPROC_ENV, WorkerMetrics
from preload.worker.engine.engine import EngineStats


class StubEngine:
    on_step = None

    def stats(self) -> EngineStats:
        return EngineStats(waiting=0, running=1, kv_blocks_used=3, kv_blocks_total=64, preemptions=1,
                           prefix_queried_tokens=12, prefix_hit_tokens=4, spec_draft_tokens=0, spec_accepted_tokens=0,
                           max_model_len=2048)


def write_as_worker(directory: Path, slot: int, requests: int) -> int:
    """A forked process that writes a worker's series for `requests` requests and exits."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return pid
    try:
        os.environ[MULTIPROC_ENV] = str(directory)
        values.ValueClass = values.MultiProcessValue()
        m = WorkerMetrics(StubEngine(), "tiny-v3", vllm_names=True)
        m.worker = str(slot)
        m.update_gauges()
        for i in range(requests):
            m.label(m.http_requests, "/v1/completions", "200").inc()
            m.label(m.prompt_tokens).inc(7)
            m.label(m.generation_tokens).inc(16)
            seq = SimpleNamespace(first_scheduled=1.01 + i, prompt=[1] * 7)
            m.finished(seq, "length", 16, 1.0 + i, 1.05 + i, 1.3 + i)
    finally:
        os._exit(0)


def scrape_seconds(directory: Path, collector, repeats: int) -> tuple[float, bytes]:
    registry = CollectorRegistry()
    registry.register(Exposition(collector, vllm_names=True))
    times, text = [], b""
    for _ in range(repeats):
        t = time.perf_counter()
        text = generate_latest(registry)
        times.append(time.perf_counter() - t)
    return statistics.median(times), text


def served(text: bytes) -> dict[str, float]:
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="preload-metrics-"))
    dead = [write_as_worker(directory, i % 2, 3) for i in range(args.processes)]
    files_before = len(list(directory.glob("*.db")))
    before, text_before = scrape_seconds(directory, MultiProcessCollector(None, path=str(directory)), args.repeats)
    t = time.perf_counter()
    absorb(directory, dead)
    absorb_s = time.perf_counter() - t
    after, text_after = scrape_seconds(directory, MetricsDirCollector(directory), args.repeats)
    one = write_as_worker(directory, 0, 3)  # a reap once the dir is small: what the supervisor's thread spends
    t = time.perf_counter()
    absorb(directory, [one])
    absorb_one_s = time.perf_counter() - t
    b, a = served(text_before), served(text_after)
    gauges = ("num_requests", "kv_", "gpu_cache")  # livesum: the dead's left with them
    assert {k: v for k, v in b.items() if not any(g in k for g in gauges)} == \
           {k: v for k, v in a.items() if not any(g in k for g in gauges)}, "the sums changed"
    print(json.dumps({"processes": args.processes, "files_before": files_before, "scrape_before_s": round(before, 4),
                      "absorb_s": round(absorb_s, 4), "absorb_one_s": round(absorb_one_s, 4),
                      "files_after": len(list(directory.glob("*.db"))), "scrape_after_s": round(after, 4),
                      "owners_left": len(owners(directory)), "samples": len(a)}))


if __name__ == "__main__":
    main()
