"""The gateway's gRPC client of the Capture service; gRPC errors become gateway errors here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ReadoutFailed,
    Unavailable,
)
from stateblock.protocol import tokens
from stateblock.v1 import capture_pb2, capture_pb2_grpc

PARAM_METADATA = "stateblock-param"  # set by the capture service on INVALID_ARGUMENT
ORIGIN_METADATA = "stateblock-origin"  # set by the capture service on every error it returns
# Reconnecting to a restarted capture: fast, so the first call after it is ready gets through
CHANNEL_OPTIONS = (
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
RETRY_PAUSE_S = 0.2
log = structlog.get_logger("gateway.capture_client")


class CaptureDropped(Unavailable):
    """The capture dropped the request before its forward, as its Cancel asked: nothing
    ran or was published (a 503 if a caller ever saw it: safe to send again)."""


def never_reached_capture(error: grpc.aio.AioRpcError) -> bool:
    """An UNAVAILABLE the channel made up (no capture answered): nothing ran, so sending
    the request again cannot run it twice."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return ORIGIN_METADATA not in dict(error.trailing_metadata() or ())


@dataclass(frozen=True)
class CaptureResult:
    block_id: str
    prompt_tokens: tuple[int, ...]


def translate(error: grpc.aio.AioRpcError) -> GatewayError:
    code, detail = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        meta = dict(error.trailing_metadata() or ())
        return InvalidRequest(detail, meta.get(PARAM_METADATA))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"capture did not finish in time: {detail}")
    if code == grpc.StatusCode.INTERNAL:
        return ReadoutFailed(detail)
    if code == grpc.StatusCode.CANCELLED and dict(error.trailing_metadata() or ()).get(
        ORIGIN_METADATA
    ):
        return CaptureDropped(f"the capture dropped it before its forward: {detail}")
    if code == grpc.StatusCode.UNAUTHENTICATED:  # the gateway's token, not the client's fault
        return Unavailable(f"the capture refused the gateway's token: {detail}")
    return Unavailable(f"capture service unavailable ({code.name}): {detail}")


class GrpcCaptureClient:
    def __init__(self, channel: grpc.aio.Channel, token: str | None = None) -> None:
        self._stub = capture_pb2_grpc.CaptureStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        # the internal token on every Capture call (health needs none)
        self._metadata = tokens.bearer(token) if token is not None else None

    async def answering(self, timeout: float) -> None:
        """Returns once a capture says SERVING to a health check (its own readiness: NATS
        answering too); raises otherwise. The gateway's readiness probe. The check carries
        the gateway's token, which a capture that holds another refuses."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Unavailable(f"the capture refused this gateway's token: {e.details()}") from e
            raise
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise Unavailable(f"the capture says {name}")

    async def capture(
        self, request: capture_pb2.CaptureRequest, *, timeout: float
    ) -> CaptureResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                response = await self._stub.Capture(
                    request, timeout=deadline - loop.time(), metadata=self._metadata
                )
                break
            except grpc.aio.AioRpcError as e:
                # a capture restarting, or none reachable yet: again while the deadline
                # allows (503 at the end: not executed, safe for the client to retry)
                if not never_reached_capture(e) or deadline - loop.time() < 2 * RETRY_PAUSE_S:
                    raise translate(e) from e
                await asyncio.sleep(RETRY_PAUSE_S)
        return CaptureResult(response.block_id, tuple(response.prompt_tokens))

    async def cancel(self, request_id: str, *, timeout: float) -> bool:
        """Ask the capture to drop a request whose forward has not started; True if it did
        (its Capture call then ends in CaptureDropped). False when it has started, or when
        the capture cannot be asked: its Capture call's own end says what became of it."""
        try:
            reply = await self._stub.Cancel(
                capture_pb2.CancelRequest(request_id=request_id),
                timeout=timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            log.warning("capture cancel not delivered", code=e.code().name, detail=e.details())
            return False
        return reply.dropped
