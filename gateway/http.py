"""The OpenAI-compatible HTTP app and its server: middleware, the error handlers and each
endpoint family's router (`gateway/openai/`), served by uvicorn."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gateway.middleware import ApiKey, BodyLimit
from gateway.openai import chat, completions, models, tokenize
from gateway.openai.errors import install_error_handlers
from gateway.service import GatewayService
from stateblock.nats_client import Readiness


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
    install_error_handlers(app)
    state = app.state  # each family's serving object, as its routes find it
    state.openai_serving_models = models.ServingModels(
        service, created=created, metrics=metrics, readiness=readiness
    )
    state.openai_serving_tokenization = tokenize.ServingTokenization(service)
    state.openai_serving_completion = completions.ServingCompletion(service)
    state.openai_serving_chat = chat.ServingChat(service)
    for family in (models, tokenize, completions, chat):
        family.attach_router(app)
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
