"""The gateway's gRPC client of the Capture service; gRPC errors become gateway errors here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ReadoutFailed,
    Unavailable,
)
from stateblock.v1 import capture_pb2, capture_pb2_grpc

PARAM_METADATA = "stateblock-param"  # set by the capture service on INVALID_ARGUMENT


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
    return Unavailable(f"capture service unavailable ({code.name}): {detail}")


class GrpcCaptureClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = capture_pb2_grpc.CaptureStub(channel)

    async def capture(
        self,
        request_id: str,
        model: str,
        lanes: Sequence[capture_pb2.CaptureLane],
        *,
        timeout: float,
    ) -> CaptureResult:
        request = capture_pb2.CaptureRequest(request_id=request_id, model=model, lanes=lanes)
        try:
            response = await self._stub.Capture(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e) from e
        return CaptureResult(response.block_id, tuple(response.prompt_tokens))
