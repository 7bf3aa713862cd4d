"""The daemon's HTTP face for probes and dashboards: /health, /status, /metrics.

Three routes on Starlette, FastAPI's base, not FastAPI: imported after torch, FastAPI
(pydantic) costs 0.29 s of the daemon's start before its load can begin, Starlette 0.03."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from preload.ipc.exposition import Exposition
from preload.ipc.metrics_files import MetricsDirCollector, absorb, owners
from preload.preloadd.state_dir import MULTIPROC_ENV, StateDirError

log = logging.getLogger("preload.daemon")


class DaemonMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.load_seconds = Gauge("preload_load_seconds", "Seconds from start to all weights resident", registry=self.registry)
        self.resident_bytes = Gauge("preload_resident_bytes", "Bytes of weights resident in arenas", ["device"], registry=self.registry)
        self.attaches = Counter("preload_attaches", "Clients that attached to the weights", registry=self.registry)
        self.errors = Counter("preload_errors", "Refused or malformed control requests", registry=self.registry)
        self.attached = Gauge("preload_attached_clients", "Clients attached now", registry=self.registry)

    def read_workers(self, directory: Path, vllm_names: bool = False) -> None:
        """Also expose the workers' series (their files in `directory`): /metrics on the
        daemon's port then serves the same sums as the API port does, under vLLM's names
        too when its workers export those (`vllm_names`: they run with --vllm-metrics,
        which the daemon's workers all share), so that a scraper pointed at either port
        sees the same series."""
        self.registry.register(Exposition(MetricsDirCollector(directory), vllm_names))


def worker_gone(pid: int) -> None:
    """A reaped worker's gauges leave the sums; its counts stay in them (they never go
    down), merged into the directory's archives, and its files go (ipc/metrics_files.py).
    Any other dead process's files go the same way: an orphan that died before it was
    adopted, a worker's own child. Called by the supervisor's thread as it reaps."""
    if MULTIPROC_ENV in os.environ:
        directory = Path(os.environ[MULTIPROC_ENV])
        try:
            absorb(directory, {pid} | dead_owners(directory))
        except Exception:  # (bookkeeping: it must never stop the supervisor; the files stay, counted as before)
            log.exception("the metrics files of pid %d could not be merged", pid)


def dead_owners(directory: Path, owned: set[int] | None = None) -> set[int]:
    """The pids of files in `directory` (`owned`, if listed already) whose processes have
    exited (a zombie, not reaped yet, has not: it is absorbed when it is)."""
    return {pid for pid in (owners(directory) if owned is None else owned) if not psutil.pid_exists(pid)}


def prepare_metrics_dir(directory: Path) -> None:
    """The workers' metrics dir as a starting daemon finds it. If workers of the last
    daemon live (their files' pids), they carry their series on, to be adopted: the
    files of those that died while no daemon watched are absorbed (the sums never go
    down). If none lives, nothing carries the series on: every file goes and the counts
    start anew, as any restarted server's do."""
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.is_symlink():  # (its files are deleted below: never those of where a link points)
        raise StateDirError(f"{directory} is a symbolic link, which preload never follows; remove it")
    owned = owners(directory)
    dead = dead_owners(directory, owned)
    if owned - dead:
        absorb(directory, dead)
        for f in directory.glob(".*.tmp"):  # a crashed absorb's
            f.unlink()
    else:
        for f in directory.iterdir():
            f.unlink()


def make_app(status: Callable[[], dict], metrics: DaemonMetrics, sleep: Callable[[str, int | None], dict] | None = None,
             api_key: str | None = None) -> Starlette:
    """/health, /status, /metrics; and, as vLLM names them, GET /is_sleeping and (operator
    only: the request must carry `api_key`, and without one the routes are refused, since
    anyone on the host reaches this port) POST /sleep?level=N and POST /wake_up, which
    `sleep(op, level)` queues and which answer once the daemon is asleep, or ready."""

    def health(_: Request) -> JSONResponse:
        s = status()
        ready = s["state"] == "ready"
        body = {"status": s["state"]} | ({} if ready else {"progress": s.get("progress")})
        return JSONResponse(body, status_code=200 if ready else 503)

    def status_route(_: Request) -> JSONResponse:
        return JSONResponse(status())

    def metrics_route(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def is_sleeping(_: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": status()["state"] == "sleeping"})

    def operator(request: Request) -> JSONResponse | None:
        """A refusal, unless the request comes from the operator."""
        if sleep is None:
            return JSONResponse({"error": "this daemon runs no workers: nothing sleeps"}, status_code=404)
        if not api_key:
            return JSONResponse({"error": "operator only: use `preload sleep` / `preload wake` on the daemon's host,"
                                          " or start the daemon with --api-key and send it"}, status_code=403)
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "operator only: a valid API key is needed"}, status_code=401)
        return None

    def sleep_route(request: Request) -> JSONResponse:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            return JSONResponse({"error": "level: 1 or 2"}, status_code=400)
        return refused if (refused := operator(request)) else until(sleep("sleep", level),
                                                                    lambda s: (s.get("sleep") or {}).get("asleep"))

    def wake_route(request: Request) -> JSONResponse:
        return refused if (refused := operator(request)) else until(sleep("wake", None), lambda s: s["state"] == "ready")

    def until(reply: dict, done: Callable[[dict], bool]) -> JSONResponse:
        if reply.get("ok") is False:
            return JSONResponse({"error": reply["error"]}, status_code=400)
        deadline = time.monotonic() + OPERATOR_WAIT
        while not done(s := status()):
            if time.monotonic() > deadline:
                return JSONResponse({"error": f"not done within {OPERATOR_WAIT:.0f} s ({s['state']})"}, status_code=504)
            time.sleep(0.02)
        return JSONResponse({})

    return Starlette(routes=[Route("/health", health), Route("/status", status_route), Route("/metrics", metrics_route),
                             Route("/is_sleeping", is_sleeping), Route("/sleep", sleep_route, methods=["POST"]),
                             Route("/wake_up", wake_route, methods=["POST"])])


OPERATOR_WAIT = 300.0  # seconds POST /sleep and /wake_up wait for the daemon to be asleep, or ready


class HttpServer:
    """uvicorn in a background thread over an already bound socket."""

    def __init__(self, app: Starlette, sock: socket.socket):
        self.sock = sock
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
