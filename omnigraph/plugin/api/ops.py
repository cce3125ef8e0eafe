"""Operational routes: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from omnigraph.plugin.api.metrics import CONTENT_TYPE
from omnigraph.plugin.api.service import NOT_READY_RETRY_AFTER_S, DecisionService

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process can serve (or is still starting); 503 with the reason while a stage
    cannot serve: `recovering` (with Retry-After) while it comes back by itself, `failed` when not."""
    service: DecisionService = request.app.state.service
    failure = service.health_failure()
    if failure is not None:
        return JSONResponse({"status": "failed", "reason": failure}, status_code=503)
    recovering = service.health_recovering()
    if recovering is not None:
        return JSONResponse({"status": "recovering", "reason": recovering}, status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
    return JSONResponse({"status": "ok" if service.ready else "starting", "model": service.model_name})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 only after the pipeline started and a real warmup request passed through it."""
    service: DecisionService = request.app.state.service
    failure = service.health_failure()
    if failure is not None:
        return JSONResponse({"ready": False, "reason": failure}, status_code=503)
    recovering = service.health_recovering()
    if recovering is not None:
        return JSONResponse({"ready": False, "reason": recovering}, status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
    if not service.ready:
        return JSONResponse({"ready": False, "reason": "the pipeline is still starting"}, status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
    return JSONResponse({"ready": True, "model": service.model_name})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
