"""The gateway's error tree. Each edge translates it once: `grpc_server.status_of` to a gRPC
status, `http.openai_error` to an OpenAI error body."""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every failure a client sees."""


class InvalidRequest(GatewayError):
    """400 / INVALID_ARGUMENT: the request cannot be served as asked."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.param = param
        self.code = code
        super().__init__(message)


class ModelNotFound(InvalidRequest):
    """404 / NOT_FOUND: the request names a model this server does not serve."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "model", "model_not_found")


class DeadlineExceeded(GatewayError):
    """504 / DEADLINE_EXCEEDED: no committed answer before the request's deadline."""


class Unavailable(GatewayError):
    """503 / UNAVAILABLE: nothing can serve the request now (capture or NATS unreachable)."""


class ReadoutFailed(GatewayError):
    """500 / INTERNAL: the capture or its block failed an integrity check."""


class BlockRejected(ReadoutFailed):
    """A block's rejection, signed by a trusted readout key; `reason` is the worker's (the
    gateway captures again for the reasons that are not the request's own)."""

    def __init__(self, block_id: str, reason: str, detail: str = "") -> None:
        self.block_id = block_id
        self.reason = reason
        self.detail = detail
        super().__init__(
            f"block {block_id} was rejected: {reason}" + (f" ({detail})" if detail else "")
        )
