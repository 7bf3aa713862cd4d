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
    """On SIGTERM/SIGINT: /health turns 503, new requests are refused, in-flight ones
    finish (up to the drain timeout), then uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, state: WorkerState, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.state, self.engine, self.drain_timeout = state, engine, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        if self.state.phase == "draining":
            return super().handle_exit(sig, frame)  # a second signal: stop now
        log.info("draining %d in-flight requests", self.engine.in_flight())
        self.state.phase = "draining"
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


async def warm_up(engine: AsyncEngine, state: WorkerState, on_ready: Callable[[], None] | None) -> None:
    """Answer one real request before claiming to be healthy."""
    seq = Sequence([0], SamplingParams(max_tokens=1))
    async for _ in engine.generate(seq):
        pass
    state.phase = "ready"
    log.info("ready in %.3f s", time.monotonic() - state.started)
    if on_ready:
        await asyncio.get_running_loop().run_in_executor(None, on_ready)


def serve(opts: ServeOptions, sock: socket.socket | None = None, on_ready: Callable[[], None] | None = None) -> None:
    state = WorkerState()
    llm = LLM(opts.model, state_dir=opts.state_dir, engine=opts.engine)
    name = opts.served_model_name or Path(llm.attached.manifest["model"]).name
    engine = AsyncEngine(llm.engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        warming = asyncio.ensure_future(warm_up(engine, state, on_ready))
        yield
        warming.cancel()

    app = create_app(engine, llm.tokenizer, name, state, opts.trust_request_chat_template, lifespan)

    if sock is None:
        sock = listen(opts.host, opts.port)
    config = uvicorn.Config(BodyLimit(app, opts.max_request_bytes), log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, state, engine, opts.drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        llm.close()


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
