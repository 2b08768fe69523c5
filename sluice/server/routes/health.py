"""GET /health, /stats and /metrics: is the engine up, and how busy is it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from sluice.server.context import server_context
from sluice.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    ctx = server_context(request)
    if not ctx.llm.is_running:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    # Draining: a load balancer should stop sending requests here.
    if ctx.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    return server_context(request).llm.stats()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = server_context(request)
    return Response(ctx.metrics.render(ctx.llm.stats()), media_type=CONTENT_TYPE)
