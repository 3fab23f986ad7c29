"""POST /v1/chat/completions: the route, its serving object and its shape of a generation."""

from __future__ import annotations

import functools

from fastapi import APIRouter, FastAPI, Request

from gateway import protocol as p
from gateway.errors import InvalidRequest
from gateway.generation import ChoiceResult, Piece
from gateway.logprobs import chat_logprobs
from gateway.openai.serving import IdempotencyKey, Shape, respond, screen, with_cancellation
from gateway.params import GenerateParams, PromptSpec, Served, check, make_sampling
from gateway.service import GatewayService

router = APIRouter()


def to_params(req: p.ChatCompletionRequest, served: Served) -> GenerateParams:
    """The request as the one checked GenerateParams; every check names the request's own field:
    chat counts log-probabilities in `top_logprobs`, and its answer depth is
    `max_completion_tokens` when given (`max_tokens`, deprecated, otherwise)."""
    stop = screen(req)
    for m in req.messages:
        if m.role not in p.ROLES:
            raise InvalidRequest(
                f"Unknown message role {m.role!r}: one of {', '.join(p.ROLES)}.", "messages"
            )
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs: true`.", "top_logprobs")
    depth = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    names = (("logprobs", "top_logprobs"), ("max_tokens", depth))
    params = GenerateParams(
        model=req.model,
        inputs=(PromptSpec(messages=tuple((m.role, m.text()) for m in req.messages)),),
        n=1 if req.n is None else req.n,
        max_tokens=getattr(req, depth),
        sampling=make_sampling(req.temperature, req.seed, names=names, **req.sampling_fields()),
        stop=stop,
    )
    return check(params, served, names)


class ChatShape(Shape):
    """The chat shape: a stream opens each choice with its role, sends text as deltas and
    ends each choice with an empty delta carrying its finish reason."""

    prefix = "chatcmpl"
    response = p.ChatCompletionResponse
    chunk = p.ChatCompletionChunk

    def choice(self, c: ChoiceResult) -> p.ChatChoice:
        lps = c.logprobs
        return p.ChatChoice(
            index=c.index,
            message=p.AssistantMessage(content=c.text),
            logprobs=None if lps is None else chat_logprobs(lps, self.service.token_text),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def opening(self, c: ChoiceResult) -> p.ChatChunkChoice:
        return p.ChatChunkChoice(index=c.index, delta=p.Delta(role="assistant", content=""))

    def piece(self, piece: Piece, c: ChoiceResult, lps, offset: int) -> list[p.ChatChunkChoice]:
        out = []
        if piece.text:
            logprobs = None if lps is None else chat_logprobs(lps, self.service.token_text)
            delta = p.Delta(content=piece.text)
            out.append(p.ChatChunkChoice(index=piece.index, delta=delta, logprobs=logprobs))
        if piece.finish_reason is not None:
            done = p.ChatChunkChoice(
                index=piece.index,
                delta=p.Delta(),
                finish_reason=piece.finish_reason,
                stop_reason=c.stop_reason,
            )
            out.append(done)
        return out


class ServingChat:
    def __init__(self, service: GatewayService) -> None:
        self.service = service

    async def create(self, req: p.ChatCompletionRequest, idempotency_key: str | None):
        convert = functools.partial(to_params, req)
        g = await self.service.generate(convert, api="chat", idempotency_key=idempotency_key)
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        return respond(ChatShape(self.service), g, stream=bool(req.stream), with_usage=with_usage)


def serving(request: Request) -> ServingChat:
    return request.app.state.openai_serving_chat


@router.post("/v1/chat/completions")
@with_cancellation
async def create_chat_completion(
    req: p.ChatCompletionRequest, raw_request: Request, idempotency_key: IdempotencyKey = None
):
    return await serving(raw_request).create(req, idempotency_key)


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
