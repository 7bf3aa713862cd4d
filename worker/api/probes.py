"""What probes and dashboards read: /health, /metrics, /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from preload.worker.api.serving import serving

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 only when a request would be answered correctly now."""
    s = serving(request)
    ok = s.state.serving and s.engine.alive
    phase = s.state.phase if s.engine.alive else "engine failed"
    return JSONResponse({"status": phase}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(serving(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    s = serving(request)
    card = {"id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "preload",
            "max_model_len": s.engine.stats().max_model_len}
    return {"object": "list", "data": [card]}
