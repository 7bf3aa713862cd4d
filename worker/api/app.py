"""The worker's HTTP app: the OpenAI-compatible routes (completions.py, chat.py,
tokens.py), the probes (probes.py), error bodies (errors.py) and a middleware that counts requests and,
while the worker drains, closes each connection after its response."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.api import chat, completions, probes, tokens
from preload.worker.api.errors import add_error_handlers
from preload.worker.api.metrics import WorkerMetrics
from preload.worker.api.serving import Serving
from preload.worker.api.state import WorkerState
from preload.worker.engine.async_engine import AsyncEngine

HEADER_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def create_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    state: WorkerState,
    trust_request_chat_template: bool = False,
    lifespan=None,
) -> FastAPI:
    app = FastAPI(title="preload worker", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = WorkerMetrics(engine, model_name)
    app.state.serving = Serving(engine, tokenizer, model_name, state, metrics, trust_request_chat_template)
    add_error_handlers(app)
    for module in (completions, chat, tokens, probes):
        app.include_router(module.router)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        # The route's template, never the path a client chose: one series per endpoint, not per URL.
        route = request.scope.get("route")
        metrics.label(metrics.http_requests, getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        ignored = getattr(request.state, "ignored_fields", None)
        if ignored:  # names a header can carry (the log has them all)
            response.headers["x-ignored-fields"] = ",".join(n for n in ignored if HEADER_SAFE.fullmatch(n))[:1024]
        if state.phase == "draining":
            response.headers["connection"] = "close"  # the client's next request goes to another worker
        return response

    return app
