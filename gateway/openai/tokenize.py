"""vLLM's POST /tokenize and /detokenize: the routes and their serving object."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request

from gateway import protocol as p
from gateway.errors import ModelNotFound
from gateway.service import GatewayService

router = APIRouter()


class ServingTokenization:
    def __init__(self, service: GatewayService) -> None:
        self.service = service

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist.")

    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        self._check_model(req.model)
        tokens = self.service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        limits = self.service.limits
        return p.TokenizeResponse(
            count=len(tokens),
            max_model_len=limits.prompt_len_max + limits.answer_depth_max,
            tokens=tokens,
        )

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self._check_model(req.model)
        return p.DetokenizeResponse(prompt=self.service.detokenize(req.tokens))


def serving(request: Request) -> ServingTokenization:
    return request.app.state.openai_serving_tokenization


@router.post("/tokenize")
async def tokenize(req: p.TokenizeRequest, raw_request: Request) -> p.TokenizeResponse:
    return serving(raw_request).tokenize(req)


@router.post("/detokenize")
async def detokenize(req: p.DetokenizeRequest, raw_request: Request) -> p.DetokenizeResponse:
    return serving(raw_request).detokenize(req)


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
