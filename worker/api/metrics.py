"""The worker's Prometheus series: requests, tokens, latencies, and the engine's state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from preload.worker.engine.async_engine import AsyncEngine


class WorkerMetrics:
    def __init__(self, engine: AsyncEngine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("preload_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("preload_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("preload_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("preload_time_to_first_token_seconds", "Request arrival to first token", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("preload_inter_token_latency_seconds", "Time between tokens of a request", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        # Read at each scrape (a supervised worker swaps its warm-up engine for the real one).
        gauges = [
            ("preload_queue_depth", "Requests waiting to be scheduled", lambda s: s.waiting),
            ("preload_running_requests", "Requests in the running batch", lambda s: s.running),
            ("preload_kv_blocks_used", "KV cache blocks in use", lambda s: s.kv_blocks_used),
            ("preload_kv_blocks_total", "KV cache blocks", lambda s: s.kv_blocks_total),
            ("preload_preemptions", "Sequences preempted so far", lambda s: s.preemptions),
        ]
        for name, help_, read in gauges:
            Gauge(name, help_, registry=r).set_function(lambda read=read: read(engine.stats()))
