"""Keep-alive clients do not stay on the survivors: after a worker is replaced, clients
that keep their connections open reach the replacement too, because a worker closes a
keep-alive connection once it is CONNECTION_AGE old (the client reconnects through the
daemon's socket, to whichever worker accepts)."""

from __future__ import annotations

import threading
import time

import httpx
from daemons import free_port, metrics, running_daemon, total
from supervised import PROMPT, api, kill, start_args, wait_replaced, workers_of

from preload.worker.api.app import CONNECTION_AGE


def served_by(d, slot: str) -> float:
    m = metrics(httpx.get(d.url + "/metrics", timeout=30).text)
    return total(m, "preload_http_requests_total", route="/v1/completions", status="200", worker=slot)


def test_keep_alive_clients_reach_a_replaced_worker(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2)) as d:
        stop, errors = threading.Event(), []
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
        with httpx.Client(base_url=api(port), timeout=60, limits=limits) as client:

            def load():
                while not stop.is_set():
                    try:
                        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
                    except httpx.HTTPError as e:  # the killed worker's connections break: expected
                        errors.append(e)

            threads = [threading.Thread(target=load) for _ in range(8)]
            for t in threads:
                t.start()
            try:
                time.sleep(1)
                old = {w["slot"]: w["pid"] for w in workers_of(d)}
                kill(old[0])  # its keep-alive clients reconnect, all to the survivor
                wait_replaced(d, {0: old[0]})
                before = served_by(d, "0")
                time.sleep(CONNECTION_AGE + 5)
                after = served_by(d, "0")
            finally:
                stop.set()
                for t in threads:
                    t.join()
        assert after - before >= 8, f"the replacement served {after - before} requests of keep-alive clients"
