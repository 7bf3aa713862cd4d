"""A worker's HTTP server (uvicorn): its configuration, and the draining a SIGTERM starts.
Imported only by the processes that serve HTTP (a slot's front, a worker on its own):
worker/serve.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import uvicorn

from preload.worker.api.limits import BodyLimit
from preload.worker.api.state import WorkerState
from preload.worker.engine.async_engine import AsyncEngine

log = logging.getLogger("preload.worker")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: turn /health 503, finish the requests in flight and those still
    arriving (answered with Connection: close), up to the drain timeout; then shut down.
    On the daemon's shared socket it also stops accepting at once, so that the other
    workers take new connections; alone, it keeps answering /health with 503 instead."""

    def __init__(self, config: uvicorn.Config, state: WorkerState, engine: AsyncEngine, drain_timeout: float,
                 shared_socket: bool):
        super().__init__(config)
        self.state, self.engine, self.drain_timeout, self.shared_socket = state, engine, drain_timeout, shared_socket
        self.on_drain: Callable[[], None] | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.state.phase == "draining":
            return super().handle_exit(sig, frame)  # a second signal: stop now
        log.info("draining %d in-flight requests", self.engine.in_flight())
        self.state.phase = "draining"
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        if self.shared_socket:
            for server in getattr(self, "servers", []):
                server.close()  # our copy of the daemon's socket: no new connections here
        if self.on_drain is not None:
            self.on_drain()
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


def http_config(app, w) -> uvicorn.Config:
    config = uvicorn.Config(BodyLimit(app, w.max_request_bytes), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    config.load()  # (before the slot: a spare's take-over is then only what follows)
    return config
