"""The gRPC transport: stateblock.v1.Gateway, plus the standard health and reflection services."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from gateway import errors
from gateway.auth import bearer_ok
from gateway.generation import Generation
from gateway.params import GenerateParams, PromptSpec, Served, check, make_sampling
from gateway.service import GatewayService
from gateway.stops import StopSpec
from stateblock import runtime
from stateblock.nats_client import Readiness, follow_in_health
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc

# the first kind an error is: ModelNotFound before the InvalidRequest it is
_STATUS = (
    (errors.ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ReadoutFailed, grpc.StatusCode.INTERNAL),
)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_FINISH = {
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "length": gateway_pb2.FINISH_REASON_LENGTH,
}


def status_of(error: errors.GatewayError) -> grpc.StatusCode:
    """The one translation of the gateway error tree to a gRPC status code."""
    return next(
        (code for kind, code in _STATUS if isinstance(error, kind)), grpc.StatusCode.UNKNOWN
    )


def params_of(req: gateway_pb2.GenerateRequest, served: Served) -> GenerateParams:
    """The request as the one checked GenerateParams; InvalidRequest naming the field."""
    given = [bool(req.prompt), bool(req.messages), bool(req.prompt_token_ids)]
    if sum(given) > 1:
        raise errors.InvalidRequest(
            "Set exactly one of prompt, messages and prompt_token_ids.", "prompt"
        )
    if req.messages:
        spec = PromptSpec(messages=tuple((m.role, m.content) for m in req.messages))
    elif req.prompt_token_ids:
        spec = PromptSpec(token_ids=tuple(req.prompt_token_ids))
    else:
        spec = PromptSpec(prompt=req.prompt)
    if req.HasField("sampling"):  # the path's own type, as the block header carries it
        sampling = req.sampling
    else:
        sampling = make_sampling(
            req.temperature if req.HasField("temperature") else None,
            req.seed if req.HasField("seed") else None,
            ignore_eos=req.ignore_eos,
        )
    params = GenerateParams(
        model=req.model,
        inputs=(spec,),
        n=req.n if req.HasField("n") else 1,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        sampling=sampling,
        stop=StopSpec(tuple(req.stop), tuple(req.stop_token_ids), req.include_stop_str_in_output),
    )
    return check(params, served)


def _logprobs(lps) -> list[gateway_pb2.TokenLogprob]:
    return [
        gateway_pb2.TokenLogprob(
            token_id=t.token_id,
            logprob=t.logprob,
            top_ids=[i for i, _ in t.top],
            top_logprobs=[lp for _, lp in t.top],
        )
        for t in lps
    ]


def _choice(index: int, finish_reason, eos_pos: int, stop_reason, **kw) -> gateway_pb2.Choice:
    choice = gateway_pb2.Choice(index=index, eos_pos=eos_pos, **kw)
    if finish_reason is not None:
        choice.finish_reason = _FINISH[finish_reason]
    if isinstance(stop_reason, str):
        choice.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        choice.stop_token_id = stop_reason
    return choice


def _head(g: Generation) -> dict:
    """What every response and stream chunk of a generation opens with."""
    return {"request_id": g.request_id, "model": g.model}


def _usage(g: Generation) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(
        prompt_tokens=g.prompt_tokens,
        completion_tokens=g.completion_tokens,
        total_tokens=g.total_tokens,
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService) -> None:
        self._service = service

    async def _generate(self, req: gateway_pb2.GenerateRequest, context, api: str) -> Generation:
        metadata = dict(context.invocation_metadata() or ())
        try:
            with structlog.contextvars.bound_contextvars(client_request_id=req.request_id):
                return await self._service.generate(
                    functools.partial(params_of, req),
                    api=api,
                    timeout=context.time_remaining(),
                    idempotency_key=metadata.get("idempotency-key"),
                )
        except errors.GatewayError as e:
            await context.abort(status_of(e), str(e))
            raise  # abort raises; this line only satisfies type checkers

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        g = await self._generate(request, context, "grpc")
        choices = [
            _choice(
                c.index,
                c.finish_reason,
                c.eos_pos,
                c.stop_reason,
                text=c.text,
                token_ids=c.token_ids,
                logprobs=_logprobs(c.logprobs or ()),
            )
            for c in g.choices
        ]
        return gateway_pb2.GenerateResponse(
            **_head(g), choices=choices, usage=_usage(g), client_request_id=request.request_id
        )

    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        s = self._service
        return gateway_pb2.GetModelInfoResponse(  # the limits' fields are the proto's
            model=s.model_name, default_max_tokens=s.default_max_tokens,
            decoder_digest=s.decoder_digest, **dataclasses.asdict(s.limits),
        )  # fmt: skip

    async def GenerateStream(
        self, request: gateway_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        g = await self._generate(request.request, context, "grpc_stream")
        by_index = {c.index: c for c in g.choices}
        for piece in self._service.pieces(g):
            last = by_index[piece.index] if piece.finish_reason is not None else None
            lps = by_index[piece.index].logprobs or ()
            choice = _choice(
                piece.index,
                piece.finish_reason,
                last.eos_pos if last else 0,
                last.stop_reason if last else None,
                text=piece.text,
                token_ids=piece.token_ids,
                logprobs=_logprobs(lps[piece.first : piece.first + len(piece.token_ids)]),
            )
            yield gateway_pb2.GenerateStreamResponse(**_head(g), choices=[choice])
        if request.include_usage:
            yield gateway_pb2.GenerateStreamResponse(**_head(g), usage=_usage(g))


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, names: tuple[str, ...]) -> None:
    """Server reflection as v1alpha (what grpcio-reflection ships) and as v1 (what grpcurl
    and current clients ask first). v1 is v1alpha's messages under a new package name,
    byte-identical on the wire, so the one servicer answers both method paths."""
    servicer = reflection.aio.ReflectionServicer((*names, reflection.SERVICE_NAME, REFLECTION_V1))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The Gateway service's calls need `authorization: Bearer <key>` metadata (health and
    reflection stay open, as the HTTP probes do); otherwise UNAUTHENTICATED."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
            yield  # pragma: no cover - abort raises

        self._deny = {
            False: grpc.unary_unary_rpc_method_handler(deny),
            True: grpc.unary_stream_rpc_method_handler(deny_stream),
        }

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(f"/{SERVICE}/"):
            header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
            if not bearer_ok(header, self._api_key):
                return self._deny[handler_call_details.method.endswith("Stream")]
        return await continuation(handler_call_details)


@asynccontextmanager
async def serve_grpc(
    service: GatewayService,
    host: str,
    port: int,
    grace_s: float,
    readiness: Readiness | None = None,
    api_key: str | None = None,
    tls: tuple[Path, Path] | None = None,
) -> AsyncIterator[int]:
    """Gateway + health + reflection; yields the bound port. Health goes NOT_SERVING first
    on shutdown so load balancers stop routing before in-flight requests drain."""
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = runtime.grpc_server(interceptors)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (SERVICE, health.SERVICE_NAME))
    bound = runtime.grpc_bind(server, host, port, "gateway gRPC", tls)
    await server.start()
    await follow_in_health(health_servicer, ("", SERVICE), readiness)
    try:
        yield bound
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
