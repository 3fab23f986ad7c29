"""POST /v1/completions: the route, its serving object and its shape of a generation."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, Request

from gateway import protocol as p
from gateway.errors import InvalidRequest
from gateway.generation import ChoiceResult, Piece, TokenLogprob
from gateway.logprobs import completion_logprobs
from gateway.openai.serving import IdempotencyKey, Shape, respond, screen, with_cancellation
from gateway.params import GenerateParams, PromptSpec, Served, check, make_sampling
from gateway.service import GatewayService

router = APIRouter()


def prompt_specs(prompt: str | list) -> tuple[PromptSpec, ...]:
    """OpenAI's prompt forms: a text, texts, one prompt's token ids, several prompts' ids."""
    if isinstance(prompt, str):
        return (PromptSpec(prompt=prompt),)
    if prompt and all(isinstance(x, int) for x in prompt):
        return (PromptSpec(token_ids=tuple(prompt)),)
    return tuple(
        PromptSpec(token_ids=tuple(x)) if isinstance(x, list) else PromptSpec(prompt=x)
        for x in prompt
    )


def choices_per_prompt(req: p.CompletionRequest) -> int:
    return 1 if req.n is None else req.n


def to_params(req: p.CompletionRequest, served: Served) -> GenerateParams:
    """The request as the one checked GenerateParams; every field it cannot take is
    refused by name."""
    stop = screen(req)
    if req.echo and req.logprobs is not None:
        raise InvalidRequest(
            "`echo` with `logprobs` is not supported: it asks for the prompt's "
            "log-probabilities, and the readout computes the answer's only.",
            "echo",
            "unsupported_parameter",
        )
    params = GenerateParams(
        model=req.model,
        inputs=prompt_specs(req.prompt),
        n=choices_per_prompt(req),
        max_tokens=req.max_tokens,
        sampling=make_sampling(req.temperature, req.seed, **req.sampling_fields()),
        stop=stop,
    )
    return check(params, served)


class CompletionShape(Shape):
    """The legacy completions shape; with `echo`, each choice's prompt before its text
    (vLLM's: token-id prompts decoded), in a stream as a chunk of its own."""

    prefix = "cmpl"
    response = chunk = p.CompletionResponse

    def __init__(self, service: GatewayService, echoes: Sequence[str], n: int) -> None:
        super().__init__(service)
        self._echoes, self._n = echoes, n

    def _echo(self, index: int) -> str:
        return self._echoes[index // self._n] if self._echoes else ""

    def _logprobs(self, lps: Sequence[TokenLogprob] | None, offset: int = 0):
        return None if lps is None else completion_logprobs(lps, self.service.token_text, offset)

    def choice(self, c: ChoiceResult) -> p.CompletionChoice:
        return p.CompletionChoice(
            text=self._echo(c.index) + c.text,
            index=c.index,
            logprobs=self._logprobs(c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def opening(self, c: ChoiceResult) -> p.CompletionChoice | None:
        if not self._echoes:
            return None
        return p.CompletionChoice(text=self._echo(c.index), index=c.index, finish_reason=None)

    def piece(self, piece: Piece, c: ChoiceResult, lps, offset: int) -> list[p.CompletionChoice]:
        last = piece.finish_reason is not None
        choice = p.CompletionChoice(
            text=piece.text,
            index=piece.index,
            logprobs=self._logprobs(lps, offset),
            finish_reason=piece.finish_reason,
            stop_reason=c.stop_reason if last else None,
        )
        return [choice]


class ServingCompletion:
    def __init__(self, service: GatewayService) -> None:
        self.service = service

    async def create(self, req: p.CompletionRequest, idempotency_key: str | None):
        convert = functools.partial(to_params, req)
        g = await self.service.generate(convert, api="completions", idempotency_key=idempotency_key)
        echoes = [self._prompt_text(s) for s in prompt_specs(req.prompt)] if req.echo else []
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        shape = CompletionShape(self.service, echoes, choices_per_prompt(req))
        return respond(shape, g, stream=bool(req.stream), with_usage=with_usage)

    def _prompt_text(self, spec: PromptSpec) -> str:
        return spec.prompt if spec.prompt is not None else self.service.decode(spec.token_ids or ())


def serving(request: Request) -> ServingCompletion:
    return request.app.state.openai_serving_completion


@router.post("/v1/completions")
@with_cancellation
async def create_completion(
    req: p.CompletionRequest, raw_request: Request, idempotency_key: IdempotencyKey = None
):
    return await serving(raw_request).create(req, idempotency_key)


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
