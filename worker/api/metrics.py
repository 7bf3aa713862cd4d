"""The worker's Prometheus series, with vLLM's coverage and meanings (the README maps each
to vLLM's name, so dashboards port): requests running and waiting, KV-cache usage, time
to first token, time per output token, end-to-end latency and its parts (queue, prefill,
decode), prompt and generation tokens per request, finished requests by reason,
preemptions, prefix-cache lookups and hits (in tokens), speculative tokens drafted and
accepted; and, ours alone, the engine's steps by kind, their time and the host's wait on
the GPU (step_clock.py). Every series carries `model_name`, `worker` (the slot) and
`engine` (its data-parallel rank, as vLLM labels a DP engine's series) labels.

Under a daemon every worker writes its series to files in one directory (prometheus-
client's multiprocess mode: the daemon sets PROMETHEUS_MULTIPROC_DIR under its state dir),
and any process's /metrics reads them all: a scrape of the shared API port gives the same
sums whichever worker answers, and the counts of a replaced worker stay in them, so a
counter never goes down. Gauges count live workers only. The daemon merges a reaped
worker's counts into the directory's archives and removes its files, so that the
directory stays small however often workers restart (ipc/metrics_files.py: a scrape
reads it in a way that counts each value once while that happens). A worker on its own
keeps its series in memory.

--vllm-metrics: every series that vLLM has also under vLLM's name (ipc/exposition.py).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from preload.ipc.exposition import Exposition
from preload.ipc.metrics_files import MetricsDirCollector
from preload.worker.engine.async_engine import AsyncEngine
from preload.worker.engine.sequence import Sequence
from preload.worker.engine.step_clock import KINDS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

class WorkerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str, vllm_names: bool = False):
        self.engine, self.model_name = engine, model_name
        self.worker = f"pid-{os.getpid()}"  # a supervised worker's slot once it has one (serve.py)
        self.dp_rank = "0"  # its data-parallel rank (--data-parallel-size), vLLM's `engine` label: the GPU's copy
        shared = MULTIPROC_ENV in os.environ
        # shared: the values live in the directory's files (every process's), else in this registry
        r = None if shared else CollectorRegistry()
        self.registry = CollectorRegistry()  # what /metrics exposes
        self.registry.register(Exposition(MetricsDirCollector(os.environ[MULTIPROC_ENV]) if shared else r, vllm_names))
        labels = ["model_name", "worker", "engine"]

        def counter(name: str, help_: str, extra: tuple = ()) -> Counter:
            return Counter(name, help_, [*extra, *labels], registry=r)

        def histogram(name: str, help_: str, buckets: tuple) -> Histogram:
            return Histogram(name, help_, labels, registry=r, buckets=buckets)

        def gauge(name: str, help_: str) -> Gauge:
            return Gauge(name, help_, labels, registry=r, multiprocess_mode="livesum")

        self.http_requests = counter("preload_http_requests", "HTTP requests by route template and status",
                                     ("route", "status"))
        self.request_success = counter("preload_request_success", "Requests finished, by finish reason",
                                       ("finished_reason",))
        self.prompt_tokens = counter("preload_prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("preload_generation_tokens", "Tokens generated")
        self.preemptions = counter("preload_num_preemptions", "Sequences preempted (their KV blocks taken back)")
        self.prefix_queries = counter("preload_prefix_cache_queries", "Tokens of admitted requests looked up in the"
                                      " prefix cache")
        self.prefix_hits = counter("preload_prefix_cache_hits", "Tokens found in the prefix cache")
        self.spec_drafts = counter("preload_spec_decode_num_draft_tokens", "Draft tokens the model verified")
        self.spec_accepted = counter("preload_spec_decode_num_accepted_tokens", "Draft tokens the model accepted")
        self.engine_steps = counter("preload_engine_steps", "Engine steps, by kind: prompt (prompt tokens in it),"
                                    " decode (one token a sequence), decode_ahead (launched before the previous"
                                    " step's tokens reached the host)", ("kind",))
        self.engine_step_seconds = counter("preload_engine_step_seconds", "Wall time of the engine's steps, by kind",
                                           ("kind",))
        self.gpu_wait = counter("preload_engine_gpu_wait_seconds", "Time the engine's host waited on the GPU for the"
                                " tokens of decode_ahead steps (most of their time: bound by the GPU)")
        self.ttft = histogram("preload_time_to_first_token_seconds", "Arrival to first token", LATENCY)
        self.tpot = histogram("preload_time_per_output_token_seconds", "Time between a request's tokens", LATENCY)
        self.e2e = histogram("preload_e2e_request_latency_seconds", "Arrival to the last token", LATENCY)
        self.queue = histogram("preload_request_queue_time_seconds", "Arrival to first scheduled", LATENCY)
        self.prefill = histogram("preload_request_prefill_time_seconds", "First scheduled to first token", LATENCY)
        self.decode = histogram("preload_request_decode_time_seconds", "First token to the last", LATENCY)
        self.request_prompt_tokens = histogram("preload_request_prompt_tokens", "Prompt tokens per request", TOKENS)
        self.request_generation_tokens = histogram("preload_request_generation_tokens", "Tokens generated per request",
                                                   TOKENS)
        self.running = gauge("preload_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("preload_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("preload_kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0-1)")
        self.kv_used = gauge("preload_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = gauge("preload_kv_blocks_total", "KV cache blocks")
        self.graphs_pending = gauge("preload_engine_graphs_pending", "CUDA graph buckets not captured yet (decode and"
                                    " prompt steps) and shapes of eager attention whose kernels are not compiled"
                                    " yet: a step of such a size captures or compiles one first, an idle engine"
                                    " does them one at a time")
        self._counted: dict[str, int] = {}  # the engine's running totals as last counted
        self._created_for: tuple | None = None  # the worker and engine labels whose series exist already
        engine.on_step = self.update_gauges

    def label(self, metric, *extra: str):
        return metric.labels(*extra, self.model_name, self.worker, self.dp_rank)

    def update_gauges(self) -> None:
        """The engine's state now (called after each step, from the engine thread, and at
        each scrape): gauges set, preemptions since the last call counted."""
        s = self.engine.stats()
        self.label(self.running).set(s.running)
        self.label(self.waiting).set(s.waiting)
        self.label(self.kv_usage).set(s.kv_blocks_used / max(s.kv_blocks_total, 1))
        self.label(self.kv_used).set(s.kv_blocks_used)
        self.label(self.kv_total).set(s.kv_blocks_total)
        self.label(self.graphs_pending).set(s.graphs_pending)
        for key, metric, total in (("preemptions", self.preemptions, s.preemptions),
                                   ("prefix_queries", self.prefix_queries, s.prefix_queried_tokens),
                                   ("prefix_hits", self.prefix_hits, s.prefix_hit_tokens),
                                   ("spec_drafts", self.spec_drafts, s.spec_draft_tokens),
                                   ("spec_accepted", self.spec_accepted, s.spec_accepted_tokens)):
            self._count(key, total, self.label(metric))
        for kind in KINDS:
            self._count(f"steps {kind}", getattr(s, f"{kind}_steps"), self.label(self.engine_steps, kind))
            self._count(f"seconds {kind}", getattr(s, f"{kind}_step_seconds"), self.label(self.engine_step_seconds, kind))
        self._count("gpu_wait", s.gpu_wait_seconds, self.label(self.gpu_wait))
        if self._created_for != (self.worker, self.dp_rank):  # once per label: every series exists from the start,
            self._created_for = (self.worker, self.dp_rank)  # at zero, as vLLM's do
            for series in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.queue,
                           self.prefill, self.decode, self.request_prompt_tokens, self.request_generation_tokens):
                self.label(series)

    def _count(self, key: str, total: float, series) -> None:
        """Count what the engine's running `total` gained since the last call (a new core
        starts again from zero: nothing counted until it passes the last total)."""
        new, self._counted[key] = total - self._counted.get(key, 0), total
        series.inc(max(new, 0))

    def finished(self, seq: Sequence, reason: str | None, generated: int, arrived: float, first_token: float,
                 last_token: float) -> None:
        """A request's sequence is done (`reason`, after `generated` tokens): its latencies
        and sizes (monotonic times)."""
        scheduled = seq.first_scheduled or first_token
        self.label(self.e2e).observe(last_token - arrived)
        self.label(self.queue).observe(max(scheduled - arrived, 0.0))
        self.label(self.prefill).observe(max(first_token - scheduled, 0.0))
        self.label(self.decode).observe(last_token - first_token)
        self.label(self.request_prompt_tokens).observe(len(seq.prompt))
        self.label(self.request_generation_tokens).observe(generated)
        self.label(self.request_success, reason or "abort").inc()
