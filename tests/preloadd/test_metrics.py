"""Metrics that hold with several workers: every worker writes its series to the daemon's
multiprocess directory, so /metrics on the shared API port (whichever worker answers)
and on the daemon's own port give the same exact sums, and a counter never goes down,
not even when a worker is killed and replaced. With --vllm-metrics, both ports carry the
same series under vLLM's names too (renamed from what is read from the files)."""

from __future__ import annotations

import concurrent.futures

import httpx
import psutil
from daemons import free_port, metrics, running_daemon, total, wait_for
from supervised import api, complete, kill, start_args, wait_replaced, workers_of
from vllm_names import assert_vllm_names_match

from preload.preloadd.state_dir import METRICS_DIR

REQUESTS = 24


def scrape(url: str) -> str:
    # A new connection each time, so that the daemon's socket hands it to either worker.
    return httpx.get(url + "/metrics", timeout=30, headers={"connection": "close"}).text


COUNTERS = ("preload_request_success_total", "preload_generation_tokens_total", "preload_prompt_tokens_total",
            "preload_time_to_first_token_seconds_count")


def test_sums_are_exact_whichever_process_answers_and_never_go_down(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--vllm-metrics")) as d:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: complete(port, max_tokens=5), range(REQUESTS)))
        urls = [api(port), d.url]
        seen = {name: 0.0 for name in COUNTERS}
        for i in range(50):
            if i == 25:  # a worker dies mid-way: its counts stay in the sums
                old = {w["slot"]: w["pid"] for w in workers_of(d)}
                kill(old[0])
                wait_replaced(d, {0: old[0]})
                complete(port, max_tokens=5)
            text = scrape(urls[i % 2])
            assert_vllm_names_match(text)  # on the daemon's port too: it reads the same files
            m = metrics(text)
            for name in COUNTERS:
                value = total(m, name)
                assert value >= seen[name], f"{name} went down: {seen[name]} -> {value} (scrape {i})"
                seen[name] = value
            sent = REQUESTS + (i >= 25)
            assert total(m, "preload_request_success_total", finished_reason="length") == sent
            assert total(m, "preload_http_requests_total", route="/v1/completions", status="200") == sent
            assert total(m, "preload_generation_tokens_total") == 5 * sent
        workers = {key.split('worker="')[1].split('"')[0] for key in m if key.startswith("preload_request_success")}
        assert workers <= {"0", "1"} and workers, workers  # labelled by slot, the replacement's counts under its slot
        assert total(m, "preload_num_requests_running") == 0  # gauges: the live workers only


def test_processes_say_what_they_are_in_ps(tiny_checkpoint, tmp_path):
    """setproctitle: `preload daemon`, `preload zygote`, `preload keeper`, `preload worker N` (a slot's
    engine core), `preload front N` (its HTTP front), `preload spare`."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--spare-workers", "1")) as d:
        procs = [psutil.Process(d.pid), *psutil.Process(d.pid).children(True)]
        titles = sorted(" ".join(p.cmdline()).strip() for p in procs)  # a title is one argv string
        suffix = f" --state-dir {d.state_dir}"
        assert titles == sorted(f"preload {role}{suffix}" for role in ("daemon", "zygote", "keeper", "worker 0", "worker 1",
                                                                                      "front 0", "front 1", "spare")), titles


KILLS = ("front", "core", "front", "front", "core", "front", "front")  # a slot's front writes its series


def serving_again(d, killed: int) -> bool:
    w = workers_of(d)[0]
    return w["state"] == w["front"]["state"] == "ready" and killed not in (w["pid"], w["front"]["pid"])


def test_the_metrics_dir_stays_small_however_often_workers_die(tiny_checkpoint, tmp_path):
    """Issue 36: every replaced worker's files stayed (676 after 200 restarts, a scrape
    twice as slow). The daemon merges a reaped worker's counts into the archives and
    removes its files: after each SIGKILL as many files as before, the sums exact."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1)) as d:
        directory = d.state_dir / METRICS_DIR
        complete(port, max_tokens=2)
        sent, files = 1, []
        for victim in KILLS:
            w = workers_of(d)[0]
            pid = w["front"]["pid"] if victim == "front" else w["pid"]
            kill(pid)
            assert wait_for(lambda: serving_again(d, pid), timeout=60, interval=0.02), workers_of(d)
            complete(port, max_tokens=2)
            sent += 1
            for url in (api(port), d.url):  # each a sum of the archives and the live front's files
                m = metrics(scrape(url))
                assert total(m, "preload_http_requests_total", route="/v1/completions", status="200") == sent, files
                assert total(m, "preload_generation_tokens_total") == 2 * sent
                assert total(m, "preload_e2e_request_latency_seconds_count") == sent  # a histogram's
                assert total(m, "preload_num_requests_running") == 0
            files.append(sorted(p.name for p in directory.glob("*.db")))  # (after a scrape: its gauges are written)
        assert len(files[-1]) <= 5, files  # the live front's counter, histogram, gauge; 2 archives
        assert all(len(f) == len(files[-1]) for f in files[1:]), [len(f) for f in files]  # not one more with each kill
