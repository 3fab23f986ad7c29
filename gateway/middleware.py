"""ASGI middleware of the gateway's HTTP app: the body limit and the API key, both answered
in OpenAI's error shape before a request body reaches the routes."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from gateway import protocol as p
from gateway.auth import bearer_ok


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 in OpenAI's error
    shape without being read further (by its Content-Length, or as it streams in). The body
    is read here, then handed to the app: JSON request bodies are small."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # a disconnect, later
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        detail = p.ErrorDetail(
            message=f"The request body is over the {self.limit} bytes this server accepts.",
            type="invalid_request_error",
            code="request_too_large",
        )
        response = JSONResponse(p.ErrorResponse(error=detail).model_dump(), status_code=413)
        await response(scope, receive, send)


PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKey:
    """ASGI middleware: the API routes answer 401 in OpenAI's shape without the key (as
    vLLM's --api-key: /health, /metrics and /version stay open for probes and scrapers)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header = dict(scope.get("headers", ())).get(b"authorization")
            if not bearer_ok(header, self.api_key):
                detail = p.ErrorDetail(
                    message="Missing or invalid API key (Authorization: Bearer ...).",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                response = JSONResponse(
                    p.ErrorResponse(error=detail).model_dump(),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
