"""The capture's door: every Capture call presents the internal token; health stays open."""

from __future__ import annotations

import grpc
import structlog

from stateblock.protocol import tokens
from stateblock.v1 import capture_pb2

log = structlog.get_logger("capture_svc")
CAPTURE_PREFIX = "/" + capture_pb2.DESCRIPTOR.services_by_name["Capture"].full_name + "/"
REFUSED = "missing or wrong capture token (STATEBLOCK_CAPTURE_TOKEN_FILE)"


class CaptureTokenInterceptor(grpc.aio.ServerInterceptor):
    """A call to the Capture service without `authorization: Bearer <token>` metadata is
    UNAUTHENTICATED before it reaches the servicer. Every other service (gRPC health)
    passes through without a token, so probes work; one that presents a wrong token is
    refused too, so a gateway's readiness probe, which presents its token, sees it is
    wrong before any request does."""

    def __init__(self, token: str) -> None:
        self._token = token

        async def deny(request, context: grpc.aio.ServicerContext) -> None:
            log.warning("capture call refused", peer=context.peer(), reason=REFUSED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = metadata.get(tokens.METADATA_KEY)
        if presented is not None or handler_call_details.method.startswith(CAPTURE_PREFIX):
            if not tokens.presented_ok(presented, self._token):
                return self._deny
        return await continuation(handler_call_details)
