"""What probes and dashboards read: /health (and /ping, its alias in vLLM), /status,
/metrics, /version, /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from preload.options import version as installed_version
from preload.worker.api.serving import serving

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 only when a request would be answered correctly now."""
    s = serving(request)
    ok = s.state.serving and s.engine.answering
    phase = s.state.phase if s.engine.alive else "engine failed"
    if s.engine.alive and not s.engine.answering:
        phase = "engine not answering"  # (a front whose core is silent: its successor is expected)
    if getattr(s.engine, "asleep", False) and s.state.serving:
        phase = "sleeping"  # (a front whose slot `preload sleep` put to sleep: its cores come at the wake)
    return JSONResponse({"status": phase}, status_code=200 if ok else 503)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    """As /health: SageMaker-style load balancers ask /ping."""
    return await health(request)


@router.get("/status")
async def status(request: Request):
    """The phase, and where the weights come from: the daemon's, or loaded by this worker
    itself because no daemon answered (what an operator must not miss)."""
    s = serving(request)
    return {"status": s.state.phase if s.engine.alive else "engine failed", "model": s.model_name,
            "weights": s.state.weights, "weights_note": s.state.weights_note}


@router.get("/version")
async def version():
    return {"version": installed_version()}


@router.get("/metrics")
async def metrics(request: Request):
    metrics = serving(request).metrics
    metrics.update_gauges()
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(request: Request, name: str) -> dict:
    """One served id (--served-model-name may give several; `root`, as in vLLM, is the first)."""
    s = serving(request)
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "preload",
            "root": s.model_name, "parent": None, "max_model_len": s.engine.stats().max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(request, name) for name in serving(request).model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    serving(request).check_model(model_id)
    return model_card(request, model_id)
