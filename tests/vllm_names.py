"""vLLM's names of the workers' series (--vllm-metrics), as vLLM v1 exposes them
(vllm/v1/metrics/loggers.py), and a check that a /metrics text carries each with exactly
the samples (labels, buckets, values) of the preload_ series it renames."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# vLLM's exposition name -> ours
VLLM_NAMES = {
    "vllm:num_requests_running": "preload_num_requests_running",
    "vllm:num_requests_waiting": "preload_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "preload_kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "preload_kv_cache_usage_perc",  # (its name before vLLM 0.9)
    "vllm:prompt_tokens_total": "preload_prompt_tokens_total",
    "vllm:generation_tokens_total": "preload_generation_tokens_total",
    "vllm:request_success_total": "preload_request_success_total",
    "vllm:num_preemptions_total": "preload_num_preemptions_total",
    "vllm:prefix_cache_queries_total": "preload_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "preload_prefix_cache_hits_total",
    "vllm:spec_decode_num_draft_tokens_total": "preload_spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total": "preload_spec_decode_num_accepted_tokens_total",
    "vllm:time_to_first_token_seconds": "preload_time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds": "preload_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds": "preload_time_per_output_token_seconds",  # (its newer name)
    "vllm:e2e_request_latency_seconds": "preload_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "preload_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "preload_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "preload_request_decode_time_seconds",
    "vllm:request_prompt_tokens": "preload_request_prompt_tokens",
    "vllm:request_generation_tokens": "preload_request_generation_tokens",
}
TYPES = {"_total": "counter", "_seconds": "histogram", "_prompt_tokens": "histogram", "_generation_tokens": "histogram"}


def series(text: str) -> dict[str, tuple[str, dict]]:
    """Each exposed name's type and samples ({(name suffix, labels): value}): a counter's
    under name_total, a histogram's (its _bucket, _sum and _count) under its name."""
    out = {}
    for family in text_string_to_metric_families(text):
        stem = len(family.name)
        found = {(s.name[stem:], frozenset(s.labels.items())): s.value for s in family.samples}
        out[family.name + ("_total" if family.type == "counter" else "")] = (family.type, found)
    return out


def assert_vllm_names_match(text: str) -> None:
    """Every vLLM name is there, of vLLM's type, labelled model_name and worker (and
    finished_reason, le where vLLM has them), with the values of our series."""
    exposed = series(text)
    for vllm, ours in VLLM_NAMES.items():
        assert vllm in exposed and ours in exposed, (vllm, ours, sorted(exposed))
        (vllm_type, got), (our_type, want) = exposed[vllm], exposed[ours]
        kind = next((t for suffix, t in TYPES.items() if vllm.endswith(suffix)), "gauge")
        assert vllm_type == our_type == kind, (vllm, vllm_type, our_type)
        assert got == want, f"{vllm} differs from {ours}:\n{got}\n{want}"
        assert got, vllm
        for _, labels in got:
            # (vLLM's own: model_name and engine, the data-parallel rank; ours adds the slot)
            assert {k for k, _ in labels} - {"le", "finished_reason"} == {"model_name", "engine", "worker"}, (vllm, labels)
