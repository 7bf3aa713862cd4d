"""The worker's HTTP app: the OpenAI-compatible routes (completions.py, chat.py,
tokens.py), the probes (probes.py), error bodies (errors.py) and `Accounting`, which counts responses,
names ignored fields and closes each connection after its response while the worker drains, or
once the connection has served a few seconds (keep-alive clients then spread over every worker)."""

from __future__ import annotations

import random
import re
import time

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from preload.checkpoint.tokenizer import Tokenizer
from preload.options import WorkerOptions
from preload.worker.api import chat, completions, probes, responses, tokens
from preload.worker.api.auth import RequireKey
from preload.worker.api.errors import add_error_handlers
from preload.worker.api.metrics import WorkerMetrics
from preload.worker.api.serving import Serving
from preload.worker.api.state import WorkerState
from preload.worker.engine.async_engine import AsyncEngine

HEADER_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The most seconds a keep-alive connection serves before the worker closes it (after a
# response, with `connection: close`); each connection's own limit is drawn between half
# of this and this, so that connections opened together (every client of a killed worker
# reconnects at once) do not close together. Small, so that a replaced worker has
# keep-alive clients again within a few seconds; a reconnect costs a TCP handshake.
CONNECTION_AGE = 3.0


class Accounting:
    """Every response: counted by route template and status, the request fields it
    ignored named in x-ignored-fields (set by Serving.admit), and `connection: close` while
    the worker drains, or once its keep-alive connection has served for its age (see
    CONNECTION_AGE): the client's next request then goes, on a new connection, through
    the daemon's socket to whichever worker accepts, so keep-alive clients spread over a
    replaced worker too instead of staying on the survivors. Only ever after a whole
    response: HTTP clients open a new connection for their next request, no request is
    cut off.

    Plain ASGI, not an `@app.middleware("http")`: that kind hands the endpoints a receive
    that never reports the client's disconnect, so a request whose client gave up before
    its whole response ran on for nobody."""

    def __init__(self, app, metrics: WorkerMetrics, state: WorkerState):
        self.app, self.metrics, self.state = app, metrics, state
        self.deadlines: dict[tuple, float] = {}  # client address -> when its connection is to close
        self.swept = time.monotonic()

    def _too_old(self, client: tuple | None) -> bool:
        """Whether this keep-alive connection has served its age (then forgotten: the
        client's next connection starts anew). Entries of connections that went away
        otherwise are swept once they are an age past their deadline."""
        if client is None:
            return False
        now = time.monotonic()
        if now - self.swept > CONNECTION_AGE:
            self.swept = now
            self.deadlines = {c: t for c, t in self.deadlines.items() if now - t < CONNECTION_AGE}
        key = tuple(client)
        deadline = self.deadlines.setdefault(key, now + random.uniform(CONNECTION_AGE / 2, CONNECTION_AGE))
        if now < deadline:
            return False
        del self.deadlines[key]
        return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
                ignored = scope.get("state", {}).get("ignored_fields")
                if ignored:  # names a header can carry (the log has them all)
                    headers.append((b"x-ignored-fields", ",".join(n for n in ignored if HEADER_SAFE.fullmatch(n))[:1024].encode()))
                if self.state.phase == "draining" or self._too_old(scope.get("client")):
                    headers.append((b"connection", b"close"))
                message = message | {"headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # The route's template, never the path a client chose: one series per endpoint, not per URL.
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.label(self.metrics.http_requests, route, str(status)).inc()


def create_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    state: WorkerState,
    options: WorkerOptions | None = None,
    lifespan=None,
) -> FastAPI:
    """The app around `engine` (an AsyncEngine, or a front's CoreClient). `model_name`: the
    id served unless the operator's options name others (--served-model-name)."""
    w = options or WorkerOptions()
    names = w.served_model_name or (model_name,)
    app = FastAPI(title="preload worker", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = WorkerMetrics(engine, names[0], vllm_names=w.vllm_metrics)
    app.state.serving = Serving(engine, tokenizer, names, state, metrics, w)
    add_error_handlers(app)
    for module in (completions, chat, responses, tokens, probes):
        app.include_router(module.router)

    app.add_middleware(Accounting, metrics=metrics, state=state)
    if w.key:
        app.add_middleware(RequireKey, key=w.key)
    if w.allowed_origins:  # (outermost: a preflight is answered before the key is asked for, as browsers need)
        app.add_middleware(CORSMiddleware, allow_origins=list(w.allowed_origins),
                           allow_methods=list(w.allowed_methods or ("*",)), allow_headers=list(w.allowed_headers or ("*",)),
                           allow_credentials=w.allow_credentials)
    return app
