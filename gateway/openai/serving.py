"""What the completions and chat families share: the screening every request passes, and
`respond`, the one renderer of a `Generation` as a response or an SSE stream of chunks.
A family says only what differs, as a `Shape`: its id prefix, its response and chunk types,
and how a choice, a stream's opening and one piece of a choice look. `with_cancellation`
wraps each generating route, so that a client that goes away cancels what has not started."""

from __future__ import annotations

import asyncio
import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Annotated, ClassVar

import structlog
from fastapi import Header, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway import protocol as p
from gateway.errors import InvalidRequest
from gateway.generation import ChoiceResult, Generation, Piece, TokenLogprob
from gateway.service import GatewayService
from gateway.stops import StopSpec

log = structlog.get_logger("gateway.http")
# a client's retry key (gateway/idempotency.py): the same key, the first request's answer
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


def with_cancellation(route: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Run `route` (which takes `raw_request`) as a task beside one that listens for the
    client's `http.disconnect`: a client that goes away cancels the route's task, and with
    it the gateway's Capture call, as a gRPC client's cancel does (a capture still queued
    never runs; once its block is published, the block is read and committed anyway).
    The route's answer, once it has one, is sent as usual; a stream's remaining chunks stop
    at a disconnect by Starlette's own listener."""

    @functools.wraps(route)
    async def wrapper(*args, raw_request: Request, **kwargs):
        work = asyncio.ensure_future(route(*args, raw_request=raw_request, **kwargs))
        gone = asyncio.ensure_future(_disconnected(raw_request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        await asyncio.gather(work, return_exceptions=True)  # its end, whatever it is
        return None  # nobody reads it

    return wrapper


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def screen(req: p._Request) -> StopSpec:
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


def usage(g: Generation) -> p.Usage:
    return p.Usage(
        prompt_tokens=g.prompt_tokens,
        completion_tokens=g.completion_tokens,
        total_tokens=g.total_tokens,
    )


class Shape(ABC):
    """One API's rendering of a generation: what differs between completions and chat."""

    prefix: ClassVar[str]  # of the response id: "cmpl", "chatcmpl"
    response: ClassVar[type[BaseModel]]  # the whole answer
    chunk: ClassVar[type[BaseModel]]  # one stream chunk (choices, usage)

    def __init__(self, service: GatewayService) -> None:
        self.service = service

    @abstractmethod
    def choice(self, c: ChoiceResult) -> BaseModel:
        """One choice of the whole answer."""

    def opening(self, c: ChoiceResult) -> BaseModel | None:
        """The chunk choice a stream sends for each choice before its pieces, if any."""
        return None

    @abstractmethod
    def piece(
        self, piece: Piece, c: ChoiceResult, lps: Sequence[TokenLogprob] | None, offset: int
    ) -> list[BaseModel]:
        """The chunk choices of one piece of choice `c`; `lps`: the piece's log-probabilities
        (None: not asked for); `offset`: the characters of the choice streamed before it."""


def respond(
    shape: Shape, g: Generation, *, stream: bool, with_usage: bool
) -> BaseModel | StreamingResponse:
    """The answer as one response, or as an SSE stream of chunks ending `[DONE]`."""
    head = {
        "id": f"{shape.prefix}-{g.request_id}",
        "created": g.created,
        "model": g.model,
        "system_fingerprint": shape.service.fingerprint,
    }
    if not stream:
        return shape.response(**head, choices=[shape.choice(c) for c in g.choices], usage=usage(g))
    return _sse(_chunks(shape, g, head, with_usage))


def _chunks(shape: Shape, g: Generation, head: dict, with_usage: bool) -> Iterator[BaseModel]:
    by_index = {c.index: c for c in g.choices}
    for c in g.choices:
        opening = shape.opening(c)
        if opening is not None:
            yield shape.chunk(**head, choices=[opening])
    sent: dict[int, int] = {}  # characters of each choice streamed: the text offsets
    for piece in shape.service.pieces(g):
        c = by_index[piece.index]
        lps = None
        if c.logprobs is not None:
            lps = c.logprobs[piece.first : piece.first + len(piece.token_ids)]
        for choice in shape.piece(piece, c, lps, sent.get(piece.index, 0)):
            yield shape.chunk(**head, choices=[choice])
        sent[piece.index] = sent.get(piece.index, 0) + len(piece.text)
    if with_usage:
        yield shape.chunk(**head, choices=[], usage=usage(g))


def _sse(chunks: Iterator[BaseModel]) -> StreamingResponse:
    def body() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk.model_dump(), separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
