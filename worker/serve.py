"""One engine worker process: attach to the daemon, serve HTTP until told to stop.

/health is 503 until the worker has attached, built its engine and answered a
warm-up request correctly; on SIGTERM it turns 503 again while in-flight requests
drain (up to a timeout), then the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn

from preload.worker.async_engine import AsyncEngine
from preload.worker.engine import EngineConfig
from preload.worker.llm import LLM
from preload.worker.sampler import SamplingParams
from preload.worker.sequence import Sequence
from preload.worker.server import BodyLimit, WorkerState, create_app

log = logging.getLogger("preload.worker")


@dataclass
class ServeOptions:
    state_dir: Path
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    engine: EngineConfig = EngineConfig()
    trust_request_chat_template: bool = False
    drain_timeout: float = 30.0
    max_request_bytes: int = 4 << 20


def listen(host: str, port: int) -> socket.socket:
    """An API listening socket. TCP_NODELAY is inherited by accepted connections: without
    it, every keep-alive request after the first waits ~40 ms on Nagle's algorithm."""
    sock = socket.create_server((host, port), backlog=1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: turn /health 503, finish the requests in flight and those still
    arriving (answered with Connection: close), up to the drain timeout; then shut down.
    On the daemon's shared socket it also stops accepting at once, so that the other
    workers take new connections; alone, it keeps answering /health with 503 instead."""

    def __init__(self, config: uvicorn.Config, state: WorkerState, engine: AsyncEngine, drain_timeout: float,
                 shared_socket: bool):
        super().__init__(config)
        self.state, self.engine, self.drain_timeout, self.shared_socket = state, engine, drain_timeout, shared_socket

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
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


def serve(opts: ServeOptions, sock: socket.socket | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM. With its own socket the worker answers at once (/health 503
    until warm). Given the daemon's shared socket it warms up first and only then
    accepts: meanwhile clients wait in the backlog, or are taken by workers that are ready."""
    state = WorkerState()
    llm = LLM(opts.model, state_dir=opts.state_dir, engine=opts.engine)
    name = opts.served_model_name or Path(llm.attached.manifest["model"]).name
    engine = AsyncEngine(llm.engine, on_fatal=lambda: setattr(server, "should_exit", True))
    shared_socket = sock is not None
    if shared_socket:
        llm.generate([[0]], max_tokens=1)
        mark_ready(state)

    async def warm_up() -> None:
        async for _ in engine.generate(Sequence([0], SamplingParams(max_tokens=1))):
            pass
        mark_ready(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        if shared_socket and on_ready:
            await asyncio.get_running_loop().run_in_executor(None, on_ready)
        warming = None if shared_socket else asyncio.ensure_future(warm_up())  # /health says 503 meanwhile
        yield
        if warming:
            warming.cancel()

    app = create_app(engine, llm.tokenizer, name, state, opts.trust_request_chat_template, lifespan)
    if sock is None:
        sock = listen(opts.host, opts.port)
    config = uvicorn.Config(BodyLimit(app, opts.max_request_bytes), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, state, engine, opts.drain_timeout, shared_socket)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        llm.close()
    if engine.error is not None:  # exit non-zero: a supervisor or systemd starts a fresh worker
        raise RuntimeError(f"engine failed: {engine.error}") from engine.error


def mark_ready(state: WorkerState) -> None:
    state.phase = "ready"
    log.info("ready in %.3f s", time.monotonic() - state.started)


def serve_from_spec(spec: dict, sock: socket.socket) -> int:
    """Run a supervised worker: options as the daemon wrote them, the daemon's
    listening socket, and a `worker_ready` report to the daemon once healthy."""
    from preload.ipc.client import DaemonClient

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker-{spec['slot']} %(levelname)s %(message)s")
    opts = ServeOptions(**{k: v for k, v in spec.items() if k not in ("slot", "engine")}, engine=EngineConfig(**spec["engine"]))
    opts.state_dir = Path(opts.state_dir)

    def report_ready() -> None:
        with DaemonClient(opts.state_dir) as client:
            client.request("worker_ready", slot=spec["slot"])

    serve(opts, sock, report_ready)
    return 0


def spec_of(opts: ServeOptions) -> dict:
    """ServeOptions as JSON for the zygote (no pickle crosses a process boundary)."""
    spec = asdict(opts) | {"state_dir": str(opts.state_dir), "model": str(opts.model) if opts.model else None}
    return spec
