"""The daemon's /health tells a probe the truth at every stage: 503 with load progress
until every weight is resident, 200 once ready, 503 again while stopping. (A tiny
checkpoint loads too fast to catch the daemon mid-load, so this drives the real HTTP
server with a status the test controls.)"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from preload.ipc.sockets import listen
from preload.preloadd.health import DaemonMetrics, HttpServer, make_app


@pytest.fixture
def server():
    state = {"state": "loading", "progress": {"done_bytes": 300, "total_bytes": 1200, "fraction": 0.25}}
    sock = listen("127.0.0.1", 0)
    http = HttpServer(make_app(lambda: dict(state), DaemonMetrics()), sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield state, url
    finally:
        http.close()


def get(url: str) -> httpx.Response:
    for _ in range(50):  # the server thread may take a moment to accept
        try:
            return httpx.get(url, timeout=5)
        except httpx.ConnectError:
            time.sleep(0.05)
    return httpx.get(url, timeout=5)


def test_health_is_503_with_progress_while_loading_then_200_then_503_while_stopping(server):
    state, url = server
    loading = get(url + "/health")
    assert loading.status_code == 503
    assert loading.json()["status"] == "loading"
    assert loading.json()["progress"]["fraction"] == 0.25

    state["state"] = "ready"
    ready = get(url + "/health")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"

    state["state"] = "stopping"
    assert get(url + "/health").status_code == 503


def test_a_taken_port_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            listen("127.0.0.1", port)
