"""Probes: liveness, readiness, Prometheus metrics (what load balancers and Prometheus poll)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from omnigraph.plugin.api.metrics import CONTENT_TYPE
from omnigraph.plugin.api.routing import PlainRoute
from omnigraph.plugin.api.service import NOT_READY_RETRY_AFTER_S, DecisionService

router = APIRouter(route_class=PlainRoute)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """The System One health body: `{"status": "ok" | "backend_unavailable", "model_hash",
    "calibration_version", "prompt_template_sha256", "backend", "precision"}` (null before the
    pipeline started), plus `reason` whenever the status is not ok. 200 while the process can
    serve or is still starting; 503 while a stage cannot serve, with Retry-After while it comes
    back by itself."""
    service: DecisionService = request.app.state.service
    fields = service.health_fields()
    failure = service.health_failure()
    if failure is not None:
        return JSONResponse({"status": "backend_unavailable", **fields, "reason": failure}, status_code=503)
    recovering = service.health_recovering()
    if recovering is not None:
        return JSONResponse({"status": "backend_unavailable", **fields, "reason": recovering}, status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
    if not service.ready:  # alive, so a liveness probe keeps it: /ready says when it can answer
        return JSONResponse({"status": "backend_unavailable", **fields, "reason": "the pipeline is still starting"})
    return JSONResponse({"status": "ok", **fields})


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
