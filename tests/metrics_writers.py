"""Real processes that write Prometheus series to a multiprocess metrics directory, as
the workers do, and what a scrape of that directory serves (tests of
ipc/metrics_files.py and of the daemon's use of it)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, values

from preload.ipc.metrics_files import MetricsDirCollector


def write_as_process(directory: Path, n: float, worker: str, stay: bool = False) -> int:
    """A forked process that writes a set of series (values from `n`) to `directory` and
    exits (its pid returned, reaped), or with `stay`, lives on once they are written
    (SIGKILL and reap it)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"w", "the writer failed"
        os.close(ready_r)
        if not stay:
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        return pid
    code = 1
    try:  # (as a worker: a process whose prometheus-client writes to the directory)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        values.ValueClass = values.MultiProcessValue()
        r = CollectorRegistry()
        c = Counter("t_requests", "requests", ["worker", "status"], registry=r)
        c.labels(worker, "200").inc(n)
        c.labels("shared", "200").inc(2 * n)
        h = Histogram("t_latency_seconds", "latency", ["worker"], buckets=(0.25, 1.0, 4.0), registry=r)
        for v in (0.125, 0.5 * n, 2.0, 8.0):
            h.labels("shared").observe(v)
        Summary("t_size", "size", registry=r).observe(n + 0.5)
        Gauge("t_running", "running", registry=r, multiprocess_mode="livesum").set(n)
        Gauge("t_total", "sum gauge", registry=r, multiprocess_mode="sum").set(n)
        Gauge("t_high", "max gauge", registry=r, multiprocess_mode="max").set(n)
        Gauge("t_low", "min gauge", registry=r, multiprocess_mode="min").set(n)
        Gauge("t_last", "most recent", registry=r, multiprocess_mode="mostrecent").set(n)
        os.write(ready_w, b"w")
        while stay:
            signal.pause()
        code = 0
    finally:
        os._exit(code)


def collected(directory: Path, collector=None) -> dict[tuple, float]:
    """{(sample name, labels): value} of what a scrape serves."""
    collector = collector or MetricsDirCollector(directory)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def counts(sums: dict) -> dict:
    """All but the livesum gauge (which counts the live processes only)."""
    return {k: v for k, v in sums.items() if k[0] != "t_running"}


def absorbed(before: dict, *live: float) -> dict:
    """What a scrape served `before`, once the dead are absorbed: their shares of the
    livesum gauge gone (the family with them when no process of `live` is left)."""
    return counts(before) | ({("t_running", ()): sum(live)} if live else {})
