"""`preload bench serve` against a real daemon's worker (the bundled model on the CPU):
every request completes with exactly the tokens asked for, and the run's engine steps
come from the worker's /metrics, scraped around it: a prompt step at least per request,
decode steps for the rest; none launched ahead on a CPU, so no wait on a GPU."""

from __future__ import annotations

import json

from daemons import running_daemon

from preload.bench.driver import free_port, preload


def test_a_run_reports_its_requests_and_the_engines_steps(tmp_path):
    port = free_port()
    bench = ("bench", "serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", 3, "--prompt-len", "8:16",
             "--output-len", "4:8", "--vocab", 200)
    with running_daemon(tmp_path / "state", None, "--dtype", "float32", "--workers", 1, "--port", port):
        r = preload(*bench, "--requests", 6, "--json", tmp_path / "serve.json", timeout=120)
        # --extra-body goes into every request: penalized sampled requests; a value the server refuses
        penalized = preload(*bench, "--requests", 3, "--extra-body", '{"frequency_penalty": 0.5, "temperature": 0.7}',
                            "--json", tmp_path / "penalized.json", timeout=120)
        refused = preload(*bench, "--requests", 1, "--extra-body", '{"frequency_penalty": 9}', timeout=120)
        # the same longer prompts twice (one seed): the second run's found in the prefix cache, and says so
        again = [preload(*bench[:6], "--output-len", "4:8", "--prompt-len", "40:48", "--requests", 2, "--seed", 9,
                         "--vocab", 200, "--json", tmp_path / f"again-{i}.json", timeout=120) for i in range(2)]
    assert r.returncode == 0, r.stdout + r.stderr
    assert penalized.returncode == 0, penalized.stdout + penalized.stderr
    done = json.loads((tmp_path / "penalized.json").read_text())
    assert (done["completed"], done["config"]["extra_body"]) == (3, {"frequency_penalty": 0.5, "temperature": 0.7})
    assert refused.returncode != 0 and "frequency_penalty" in refused.stdout + refused.stderr
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    asked = sum(q["max_tokens"] for q in result["requests"])
    assert result["throughput"]["output_tokens"] == asked
    steps = result["engine_steps"]
    assert steps["prompt"]["steps"] >= 1 and steps["prompt"]["ms_per_step"] > 0
    # every token past each request's first comes from a decode step (several requests' at once)
    assert 1 <= steps["decode"]["steps"] <= asked - 6 and steps["decode"]["ms_per_step"] > 0
    assert steps["decode_ahead"]["steps"] == 0 and steps["gpu_wait_share"] is None
    assert "engine steps: prompt" in r.stdout
    first, second = (json.loads((tmp_path / f"again-{i}.json").read_text())["throughput"] for i in range(2))
    assert first["prompt_tokens_cached"] == 0 < second["prompt_tokens_cached"] <= second["prompt_tokens"]
    assert "prompt tokens found in the prefix cache: 0.0%" in again[0].stdout
    assert "prompt tokens found in the prefix cache: 0.0%" not in again[1].stdout
    assert result["config"]["graphs_wait_s"] < 5  # (a CPU captures none: nothing to wait for)


async def waited_for_graphs(pending: list[float | None], prefix: str = "", **kwargs) -> float:
    """wait_for_graphs against a real HTTP server whose /metrics (under `prefix`, as behind a
    proxy) reports each of `pending` in turn (None: no such series, as another server's),
    then the last for good."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from preload.bench.serve import client_session, wait_for_graphs

    async def metrics(request):
        value = pending.pop(0) if len(pending) > 1 else pending[0]
        text = "" if value is None else (
            "# TYPE preload_engine_graphs_pending gauge\n"
            f'preload_engine_graphs_pending{{worker="slot-0"}} {value}\n'
            f'preload_engine_graphs_pending{{worker="slot-1"}} 0.0\n')
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get(f"{prefix}/metrics", metrics)
    async with TestServer(app) as server, client_session(str(server.make_url(prefix or "/")), 2) as client:
        return await wait_for_graphs(client, **kwargs)


def test_the_run_waits_for_the_workers_cuda_graphs_to_be_captured():
    """A fresh worker captures a graph bucket at its first step of that size (0.1-0.6 s on
    the H200): the recorded run starts once /metrics says none is left (summed over the
    workers), at once where the series is absent (another server, a CPU), and gives up
    past its timeout naming how many were left."""
    import asyncio

    import pytest

    said = []
    waited = asyncio.run(waited_for_graphs([3.0, 2.0, 1.0, 0.0], progress=said.append, poll=0.01))
    assert waited >= 0.03 and said == ["waiting for the workers to capture 3 CUDA graph bucket(s)"]
    assert asyncio.run(waited_for_graphs([None], poll=10.0)) < 1.0
    with pytest.raises(RuntimeError, match="still had 5 CUDA graph bucket"):
        asyncio.run(waited_for_graphs([5.0], timeout=0.05, poll=0.01))


def test_a_url_with_a_path_keeps_it():
    """--url http://host/prefix (a server behind a proxy's path): the bench's requests go
    under that path (the /metrics it waits on here; the API's paths are named alike)."""
    import asyncio

    said = []
    asyncio.run(waited_for_graphs([1.0, 0.0], prefix="/llm", progress=said.append, poll=0.01))
    assert said == ["waiting for the workers to capture 1 CUDA graph bucket(s)"]


def test_extra_body_may_not_set_what_the_bench_counts_by():
    """The bench sets the prompt, the length, ignore_eos and streaming: its counts rest on them."""
    for body, named in (('{"max_tokens": 3}', "max_tokens"), ('{"stream": false, "n": 2}', "n, stream"),
                        ("[1]", "JSON object"), ("{nope", "--extra-body")):
        r = preload("bench", "serve", "--url", "http://127.0.0.1:9", "--extra-body", body, timeout=60)
        assert r.returncode == 2 and named in r.stdout + r.stderr, (body, r.stdout + r.stderr)
