"""The OpenAI-compatible HTTP transport: thin routes over GatewayService, errors as OpenAI bodies."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import structlog
import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import protocol as p
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    ReadoutFailed,
    Unavailable,
)
from gateway.logprobs import chat_logprobs, completion_logprobs
from gateway.middleware import ApiKey, BodyLimit
from gateway.service import (
    GatewayService,
    GenerateParams,
    Generation,
    PromptSpec,
    make_sampling,
)
from gateway.stops import StopSpec
from stateblock.nats_client import Readiness

log = structlog.get_logger("gateway.http")
# a client's retry key (gateway/idempotency.py): the same key, the first request's answer
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
try:
    VERSION = importlib.metadata.version("stateblock")
except importlib.metadata.PackageNotFoundError:  # a checkout run without installing
    VERSION = "0.0.0+unknown"


def openai_error(error: GatewayError) -> tuple[int, p.ErrorResponse]:
    """The one translation of the gateway error tree to an HTTP status and OpenAI body."""
    if isinstance(error, InvalidRequest):
        detail = p.ErrorDetail(
            message=error.message, type="invalid_request_error", param=error.param, code=error.code
        )
        return (404 if isinstance(error, ModelNotFound) else 400), p.ErrorResponse(error=detail)
    if isinstance(error, DeadlineExceeded):
        status, kind, code = 504, "timeout_error", "deadline_exceeded"
    elif isinstance(error, Unavailable):
        status, kind, code = 503, "service_unavailable_error", "unavailable"
    elif isinstance(error, ReadoutFailed):
        status, kind, code = 500, "server_error", "readout_failed"
    else:
        status, kind, code = 500, "server_error", None
    return status, p.ErrorResponse(error=p.ErrorDetail(message=str(error), type=kind, code=code))


def _json(status: int, body: BaseModel) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump())


def _validation_error(exc: RequestValidationError) -> InvalidRequest:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return InvalidRequest(
            f"The body is not valid JSON: {first.get('msg')}.", None, "invalid_json"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # pydantic reports a union member's type in the path (prompt.str); the field is enough
    param = loc[0] if loc else None
    where = ".".join(loc)
    return InvalidRequest(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param)


def _usage(g: Generation) -> p.Usage:
    return p.Usage(
        prompt_tokens=g.prompt_tokens,
        completion_tokens=g.completion_tokens,
        total_tokens=g.total_tokens,
    )


def _sse(chunks: Iterator[BaseModel]) -> StreamingResponse:
    def body() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk.model_dump(), separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _prompt_specs(prompt: str | list) -> tuple[PromptSpec, ...]:
    """OpenAI's prompt forms: a text, texts, one prompt's token ids, several prompts' ids."""
    if isinstance(prompt, str):
        return (PromptSpec(prompt=prompt),)
    if prompt and all(isinstance(x, int) for x in prompt):
        return (PromptSpec(token_ids=tuple(prompt)),)
    return tuple(
        PromptSpec(token_ids=tuple(x)) if isinstance(x, list) else PromptSpec(prompt=x)
        for x in prompt
    )


def _screen(req: p._Request) -> StopSpec:
    """Refuse what a block readout cannot honour (400 naming the field and why), log the
    fields this server does not know (as vLLM does), and read the stops."""
    refused = req.refusals()
    if refused:
        name, why = refused[0]
        raise InvalidRequest(f"`{name}` is not supported: {why}.", name, "unsupported_parameter")
    unknown = req.unknown_fields()
    if unknown:
        log.warning("unknown request fields ignored", fields=unknown)
    strings, token_ids, include = req.stop_spec()
    return StopSpec(strings, token_ids, include)


def _chat_sampling(req: p.ChatCompletionRequest):
    try:
        return make_sampling(req.temperature, req.seed, **req.sampling_fields())
    except InvalidRequest as e:
        if e.param == "logprobs":  # chat counts them in top_logprobs
            e.param = "top_logprobs"
        raise


def create_app(
    service: GatewayService,
    *,
    metrics: CollectorRegistry,
    created: int,
    readiness: Readiness | None = None,
    max_body_bytes: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    app = FastAPI(title="stateblock gateway", version="1")
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:  # added last, so it runs first: an unauthenticated body is never read
        app.add_middleware(ApiKey, api_key=api_key)

    @app.exception_handler(GatewayError)
    async def on_gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
        status, body = openai_error(exc)
        return _json(status, body)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = openai_error(_validation_error(exc))
        return _json(status, body)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown routes (404), wrong methods (405): the OpenAI shape, not FastAPI's {"detail"}
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = p.ErrorDetail(message=str(exc.detail), type=kind, code=str(exc.status_code))
        return JSONResponse(
            p.ErrorResponse(error=detail).model_dump(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def on_bug(_request: Request, exc: Exception) -> JSONResponse:
        # a bug still answers in the OpenAI shape; the traceback goes to the log, not the body
        log.exception("unhandled error", error=type(exc).__name__)
        detail = p.ErrorDetail(message="internal error", type="server_error", code="internal")
        return _json(500, p.ErrorResponse(error=detail))

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        if req.model is not None and req.model != service.model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist.")
        tokens = service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        limits = service.limits
        return p.TokenizeResponse(
            count=len(tokens),
            max_model_len=limits.prompt_len_max + limits.answer_depth_max,
            tokens=tokens,
        )

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        if req.model is not None and req.model != service.model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist.")
        return p.DetokenizeResponse(prompt=service.detokenize(req.tokens))

    @app.get("/health")
    async def health() -> JSONResponse:
        # 503 while NATS or the capture does not answer: no request could be, route elsewhere
        if readiness is not None and not readiness.ready:
            return JSONResponse({"status": "unavailable", "why": readiness.why}, status_code=503)
        return JSONResponse({"status": "ok", "model": service.model_name})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        limits = service.limits
        card = p.ModelCard(
            id=service.model_name,
            created=created,
            root=service.model_name,
            max_model_len=limits.prompt_len_max + limits.answer_depth_max,
            max_answer_tokens=limits.answer_depth_max,
            max_choices=limits.max_lanes,
        )
        return p.ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, idempotency_key: IdempotencyKey = None):
        stop = _screen(req)
        if req.echo and req.logprobs is not None:
            raise InvalidRequest(
                "`echo` with `logprobs` is not supported: it asks for the prompt's "
                "log-probabilities, and the readout computes the answer's only.",
                "echo",
                "unsupported_parameter",
            )
        params = GenerateParams(
            model=req.model,
            inputs=_prompt_specs(req.prompt),
            n=1 if req.n is None else req.n,
            max_tokens=req.max_tokens,
            sampling=make_sampling(req.temperature, req.seed, **req.sampling_fields()),
            stop=stop,
        )
        g = await service.generate(params, api="completions", idempotency_key=idempotency_key)
        rid = f"cmpl-{g.request_id}"
        # echo (vLLM's): the prompt's text before each choice's, token-id prompts decoded
        echoes = [s.prompt if s.prompt is not None else service.decode(s.token_ids or ())
                  for s in params.inputs] if req.echo else []  # fmt: skip

        def echo(index: int) -> str:
            return echoes[index // params.n] if echoes else ""

        if not req.stream:
            choices = [
                p.CompletionChoice(
                    text=echo(c.index) + c.text,
                    index=c.index,
                    logprobs=None
                    if c.logprobs is None
                    else completion_logprobs(c.logprobs, service.token_text),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in g.choices
            ]
            return p.CompletionResponse(
                id=rid,
                created=g.created,
                model=g.model,
                system_fingerprint=service.fingerprint,
                choices=choices,
                usage=_usage(g),
            )
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        stop_reasons = {c.index: c.stop_reason for c in g.choices}
        by_index = {c.index: c for c in g.choices}
        sent: dict[int, int] = {}  # characters of each choice streamed: the text offsets

        def piece_logprobs(piece) -> p.CompletionLogprobs | None:
            lps = by_index[piece.index].logprobs
            if lps is None:
                return None
            part = lps[piece.first : piece.first + len(piece.token_ids)]
            return completion_logprobs(part, service.token_text, sent.get(piece.index, 0))

        def chunks() -> Iterator[BaseModel]:
            for c in g.choices if echoes else ():  # the prompt first, as its own chunk
                yield p.CompletionResponse(
                    id=rid,
                    created=g.created,
                    model=g.model,
                    system_fingerprint=service.fingerprint,
                    choices=[
                        p.CompletionChoice(text=echo(c.index), index=c.index, finish_reason=None)
                    ],  # fmt: skip
                )
            for piece in service.pieces(g):
                last = piece.finish_reason is not None
                choice = p.CompletionChoice(
                    text=piece.text,
                    index=piece.index,
                    logprobs=piece_logprobs(piece),
                    finish_reason=piece.finish_reason,
                    stop_reason=stop_reasons[piece.index] if last else None,
                )
                sent[piece.index] = sent.get(piece.index, 0) + len(piece.text)
                yield p.CompletionResponse(
                    id=rid,
                    created=g.created,
                    model=g.model,
                    system_fingerprint=service.fingerprint,
                    choices=[choice],
                )
            if with_usage:
                yield p.CompletionResponse(
                    id=rid, created=g.created, model=g.model, choices=[], usage=_usage(g)
                )

        return _sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(
        req: p.ChatCompletionRequest, idempotency_key: IdempotencyKey = None
    ):
        stop = _screen(req)
        for m in req.messages:
            if m.role not in p.ROLES:
                raise InvalidRequest(
                    f"Unknown message role {m.role!r}: one of {', '.join(p.ROLES)}.", "messages"
                )
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs: true`.", "top_logprobs")
        messages = tuple((m.role, m.text()) for m in req.messages)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        param_name = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        params = GenerateParams(
            model=req.model,
            inputs=(PromptSpec(messages=messages),),
            n=1 if req.n is None else req.n,
            max_tokens=max_tokens,
            sampling=_chat_sampling(req),
            stop=stop,
        )
        try:
            g = await service.generate(params, api="chat", idempotency_key=idempotency_key)
        except InvalidRequest as e:
            if e.param == "max_tokens":
                e.param = param_name
            raise
        rid = f"chatcmpl-{g.request_id}"
        if not req.stream:
            choices = [
                p.ChatChoice(
                    index=c.index,
                    message=p.AssistantMessage(content=c.text),
                    logprobs=None
                    if c.logprobs is None
                    else chat_logprobs(c.logprobs, service.token_text),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in g.choices
            ]
            return p.ChatCompletionResponse(
                id=rid,
                created=g.created,
                model=g.model,
                system_fingerprint=service.fingerprint,
                choices=choices,
                usage=_usage(g),
            )
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> BaseModel:
            return p.ChatCompletionChunk(
                id=rid,
                created=g.created,
                model=g.model,
                system_fingerprint=service.fingerprint,
                choices=choices,
                usage=usage,
            )

        stop_reasons = {c.index: c.stop_reason for c in g.choices}
        by_index = {c.index: c for c in g.choices}

        def chunks() -> Iterator[BaseModel]:
            for c in g.choices:
                yield chunk(
                    [p.ChatChunkChoice(index=c.index, delta=p.Delta(role="assistant", content=""))]
                )
            for piece in service.pieces(g):
                if piece.text:
                    delta = p.Delta(content=piece.text)
                    lps = by_index[piece.index].logprobs
                    part = None
                    if lps is not None:
                        part = lps[piece.first : piece.first + len(piece.token_ids)]
                        part = chat_logprobs(part, service.token_text)
                    yield chunk([p.ChatChunkChoice(index=piece.index, delta=delta, logprobs=part)])
                if piece.finish_reason is not None:
                    done = p.ChatChunkChoice(
                        index=piece.index,
                        delta=p.Delta(),
                        finish_reason=piece.finish_reason,
                        stop_reason=stop_reasons[piece.index],
                    )
                    yield chunk([done])
            if with_usage:
                yield chunk([], _usage(g))

        return _sse(chunks())

    return app


class _Server(uvicorn.Server):
    """The process owns SIGINT/SIGTERM (its shutdown Event), not uvicorn."""

    def capture_signals(self):
        return nullcontext()


@asynccontextmanager
async def serve_http(
    app: FastAPI, host: str, port: int, grace_s: float, tls: tuple[Path, Path] | None = None
) -> AsyncIterator[int]:
    """Serve until the context exits; yields the bound port (port 0 picks a free one).
    `tls`: (certificate, key) PEM files: HTTPS."""
    # Bound here, not by uvicorn: a port in use is an OSError the caller can report in one
    # line (uvicorn logs it and calls sys.exit).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"gateway HTTP: cannot listen on {host}:{port}: {e.strerror}") from e
    cert, key = tls if tls is not None else (None, None)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
        timeout_graceful_shutdown=int(grace_s), ssl_certfile=cert, ssl_keyfile=key,
    )  # fmt: skip
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="gateway-http")
    while not server.started:
        if task.done():
            task.result()  # raises the bind error
            raise RuntimeError("HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield bound
    finally:
        server.should_exit = True
        await task
