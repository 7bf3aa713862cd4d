"""What a /metrics serves, the daemon's and the workers' alike.

--vllm-metrics (WorkerOptions.vllm_metrics) also exports every series that vLLM has under
vLLM's v1 name (vllm/v1/metrics/loggers.py): vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:prompt_tokens_total, vllm:time_to_first_token_seconds, ...
(VLLM_NAMES), so that what already reads a vLLM server works unchanged: Grafana dashboards
(vLLM's own filter by model_name), KEDA's and HPA's Prometheus queries, the Kubernetes
inference gateway's endpoint picker (it scrapes vllm:num_requests_waiting,
vllm:num_requests_running and vllm:kv_cache_usage_perc straight from /metrics). The copies
are made at scrape time from what was collected (`Exposition`): the same families, renamed,
never a second set of counters, so their values equal the preload_* ones by construction,
in one process as in the multiprocess mode (where they are renamed from what
MetricsDirCollector reads from the files: ipc/metrics_files.py). Our label names stay
(model_name, worker); the daemon's own /metrics, which reads the same files, carries the
vLLM names too when its workers run with the option (preloadd/health.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# Our families (as collected: a counter's without its _total) and vLLM v1's names of the
# same series, which --vllm-metrics exports beside them. The exposition adds _total,
# _bucket, ... to both alike (vllm:prompt_tokens -> vllm:prompt_tokens_total, as vLLM's own
# Counter("vllm:prompt_tokens") does). vLLM exports two of them twice, and so do we:
# vllm:gpu_cache_usage_perc, the pre-0.9 name of vllm:kv_cache_usage_perc (both 0-1), and
# vllm:inter_token_latency_seconds, the newer name of vllm:time_per_output_token_seconds
# (the same observations: the time between a request's tokens). Ours that vLLM lacks
# (preload_http_requests, preload_kv_blocks_*) keep their one name.
# The labels stay ours, model_name and worker: vLLM's are model_name and engine (the index
# of a data-parallel engine core, like our worker slot), but what reads these series does not
# ask for `engine`: vLLM's Grafana dashboards filter and KEDA's examples sum by model_name,
# and the inference gateway's endpoint picker takes a family's first series unless its
# operator names labels to match. A second label holding the worker's value again would
# only double the series' label sets.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "preload_num_requests_running": ("vllm:num_requests_running",),
    "preload_num_requests_waiting": ("vllm:num_requests_waiting",),
    "preload_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preload_prompt_tokens": ("vllm:prompt_tokens",),
    "preload_generation_tokens": ("vllm:generation_tokens",),
    "preload_request_success": ("vllm:request_success",),
    "preload_num_preemptions": ("vllm:num_preemptions",),
    "preload_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "preload_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "preload_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "preload_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "preload_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "preload_time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",
                                              "vllm:inter_token_latency_seconds"),
    "preload_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "preload_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "preload_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "preload_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "preload_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "preload_request_generation_tokens": ("vllm:request_generation_tokens",),
}


def renamed(family: Metric, name: str) -> Metric:
    """`family` (its samples, values, labels, buckets) under the family name `name`."""
    out = Metric(name, family.documentation, family.type, family.unit)
    stem = len(family.name)  # every sample's name is the family's plus a suffix (_total, _bucket, ...)
    out.samples = [s._replace(name=name + s.name[stem:]) for s in family.samples]
    return out


class Exposition(Collector):
    """What a /metrics serves: the families `source` collects (a registry, or a
    MetricsDirCollector over the workers' files), and with `vllm_names` each that vLLM has
    once more under vLLM's names, copied from the same collection (one read of the files)."""

    def __init__(self, source: Collector, vllm_names: bool = False):
        self.source, self.vllm_names = source, vllm_names

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield family
            if self.vllm_names:
                for name in VLLM_NAMES.get(family.name, ()):
                    yield renamed(family, name)
