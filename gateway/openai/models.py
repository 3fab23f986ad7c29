"""GET /v1/models, and the server's own: /version, /health (readiness) and /metrics."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway import protocol as p
from gateway.service import GatewayService
from stateblock.nats_client import Readiness

router = APIRouter()
try:
    VERSION = importlib.metadata.version("stateblock")
except importlib.metadata.PackageNotFoundError:  # a checkout run without installing
    VERSION = "0.0.0+unknown"


class ServingModels:
    def __init__(
        self,
        service: GatewayService,
        *,
        created: int,
        metrics: CollectorRegistry,
        readiness: Readiness | None,
    ) -> None:
        self.service = service
        self.created = created
        self.metrics = metrics
        self.readiness = readiness

    def models(self) -> p.ModelList:
        s, limits = self.service, self.service.limits
        card = p.ModelCard(
            id=s.model_name,
            created=self.created,
            root=s.model_name,
            max_model_len=limits.prompt_len_max + limits.answer_depth_max,
            max_answer_tokens=limits.answer_depth_max,
            max_choices=limits.max_lanes,
        )
        return p.ModelList(data=[card])

    def health(self) -> JSONResponse:
        # 503 while NATS or the capture does not answer: no request could be, route elsewhere
        r = self.readiness
        if r is not None and not r.ready:
            return JSONResponse({"status": "unavailable", "why": r.why}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.service.model_name})


def serving(request: Request) -> ServingModels:
    return request.app.state.openai_serving_models


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    return serving(raw_request).health()


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(generate_latest(serving(raw_request).metrics), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> p.ModelList:
    return serving(raw_request).models()


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
