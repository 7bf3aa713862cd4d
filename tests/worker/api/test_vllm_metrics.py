"""--vllm-metrics: a worker's /metrics also carries its series under vLLM's v1 names
(vllm:num_requests_waiting, vllm:prompt_tokens_total, vllm:time_to_first_token_seconds,
...), for the dashboards, autoscalers and gateways that read a vLLM server, with exactly
the values of the preload_ ones. A worker on its own (its series in memory); the
multiprocess mode of supervised workers is tested in tests/preloadd/test_metrics.py."""

from __future__ import annotations

import pytest
from daemons import metrics, running_daemon, total
from prometheus_client.parser import text_string_to_metric_families
from vllm_names import VLLM_NAMES, assert_vllm_names_match
from workers import running_workers

PROMPT = [5 + i % 90 for i in range(70)]  # four full blocks of 16 before its last token: a repeat hits them
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    """Two workers of one daemon: with --vllm-metrics, and without."""
    with running_daemon(tmp_path_factory.mktemp("vllm-metrics") / "state", model, "--dtype", "float32") as d, \
            running_workers(d.state_dir, tmp_path_factory.mktemp("logs"), ("--vllm-metrics",), ()) as ws:
        yield ws


@pytest.fixture(scope="module")
def worker(workers):
    return workers[0]


@pytest.fixture(scope="module")
def plain(workers):
    return workers[1]


def complete(worker, stream: bool = False) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    r = worker.post("/v1/completions", body)
    assert r.status_code == 200, r.text


def test_vllm_names_carry_the_values_of_the_preload_series(worker):
    for stream in (False, True, False):
        complete(worker, stream)
    r = worker.get("/metrics")
    assert r.status_code == 200
    text = r.text
    assert_vllm_names_match(text)
    exposed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    for name in VLLM_NAMES:  # the very names vLLM exposes (with the parser's view of a histogram)
        assert name in exposed or f"{name}_count" in exposed, name
    m = metrics(text)
    # What the requests did, read under vLLM's names as a dashboard would
    assert total(m, "vllm:request_success_total", finished_reason="length") == 3
    assert total(m, "vllm:generation_tokens_total") == 3 * MAX_TOKENS
    assert total(m, "vllm:prompt_tokens_total") == 3 * len(PROMPT)
    assert total(m, "vllm:prefix_cache_hits_total") >= 2 * 64
    assert total(m, "vllm:time_to_first_token_seconds_count") == 3
    assert total(m, "vllm:inter_token_latency_seconds_count") == total(m, "vllm:time_per_output_token_seconds_count") > 0
    assert total(m, "vllm:request_generation_tokens_sum") == 3 * MAX_TOKENS
    assert total(m, "vllm:num_requests_running") == total(m, "vllm:num_requests_waiting") == 0
    assert 0 <= total(m, "vllm:kv_cache_usage_perc") <= 1  # a fraction, as vLLM's v1 (not a percent)


def test_vllm_names_are_renamed_copies_not_second_counters(worker):
    """Scraped again after more requests, the vLLM names moved with ours."""
    complete(worker)
    assert_vllm_names_match(worker.get("/metrics").text)


def test_without_the_option_no_vllm_names(plain):
    complete(plain)
    text = plain.get("/metrics").text
    assert total(metrics(text), "preload_prompt_tokens_total") == len(PROMPT)
    assert "vllm:" not in text
