"""The request as the gateway's logic takes it (`GenerateParams`), and `check`, the one
set of checks against what this gateway serves. Each edge's conversion (the HTTP
families' `to_params`, gRPC's `params_of`) maps its wire type here and ends in `check`,
so a request reaches `GatewayService.generate` checked, its answer depth resolved."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import InvalidRequest, ModelNotFound
from gateway.stops import MAX_STOP_STRINGS, StopSpec
from stateblock.protocol import sampling
from stateblock.protocol.sampling import InvalidSampling, Limits
from stateblock.v1 import block_pb2

# (checked name, request field): chat's top_logprobs, max_completion_tokens
Names = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PromptSpec:
    """One distinct input: a raw prompt, a chat, or a prompt's token ids."""

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GenerateParams:
    """One request as both APIs ask it; `sampling` is the one sampling type of the path."""

    model: str
    inputs: tuple[PromptSpec, ...]
    n: int = 1
    max_tokens: int | None = None  # None: the decoder's trained depth (`check` resolves it)
    sampling: block_pb2.SamplingParams = field(default_factory=block_pb2.SamplingParams)
    stop: StopSpec = StopSpec()  # applied to the read-out block here (gateway/stops.py)


class Served(Protocol):
    """What a request is checked against: the gateway's model, limits and vocabulary."""

    model_name: str
    limits: Limits
    vocab_size: int
    default_max_tokens: int


def invalid(e: InvalidSampling, names: Names = ()) -> InvalidRequest:
    """A sampling check's failure as the gateway's InvalidRequest, naming the request's field."""
    return InvalidRequest(str(e), dict(names).get(e.param, e.param))


def make_sampling(*args, names: Names = (), **fields) -> block_pb2.SamplingParams:
    """The HTTP and gRPC mappers' one way to the sampling type: `sampling_params`'s
    arguments, its InvalidSampling as the gateway's InvalidRequest naming the field."""
    try:
        return sampling.sampling_params(*args, **fields)
    except InvalidSampling as e:
        raise invalid(e, names) from e


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    try:
        sampling.check_token_ids(ids, vocab_size, param)
    except InvalidSampling as e:
        raise invalid(e) from e


def check_prompt_text(text: str, limits: Limits, param: str) -> None:
    try:
        sampling.check_prompt_text(text, limits, param)
    except InvalidSampling as e:
        raise invalid(e) from e


def _check_input(spec: PromptSpec, served: Served) -> None:
    limits = served.limits
    if spec.token_ids is not None:
        if not spec.token_ids or len(spec.token_ids) > limits.prompt_len_max:
            raise InvalidRequest(
                f"A prompt of token ids has 1 to {limits.prompt_len_max} ids.", "prompt"
            )
        check_token_ids(spec.token_ids, served.vocab_size, "prompt")
        return
    if spec.messages is not None:
        if not spec.messages:
            raise InvalidRequest("`messages` must not be empty.", "messages")
        if not any(content for _, content in spec.messages):
            raise InvalidRequest("The messages have no content.", "messages")
        check_prompt_text("".join(content for _, content in spec.messages), limits, "messages")
    elif not spec.prompt:
        raise InvalidRequest("The prompt must not be empty.", "prompt")
    else:
        check_prompt_text(spec.prompt, limits, "prompt")


def check(p: GenerateParams, served: Served, names: Names = ()) -> GenerateParams:
    """`p` with its answer depth resolved, or InvalidRequest (ModelNotFound) for anything
    the pipeline cannot serve, naming the request's own field (`names`)."""
    if p.model != served.model_name:
        raise ModelNotFound(
            f"The model `{p.model}` does not exist; this server serves `{served.model_name}`."
        )
    if not p.inputs:
        raise InvalidRequest("The prompt must not be empty.", "prompt")
    for spec in p.inputs:
        _check_input(spec, served)
    if p.n < 1:
        raise InvalidRequest(f"n must be at least 1, got {p.n}.", "n")
    check_token_ids(p.stop.token_ids, served.vocab_size, "stop_token_ids")
    if len(p.stop.strings) > MAX_STOP_STRINGS or not all(p.stop.strings):
        raise InvalidRequest(f"`stop` takes 1 to {MAX_STOP_STRINGS} non-empty strings.", "stop")
    max_tokens = served.default_max_tokens if p.max_tokens is None else p.max_tokens
    try:
        sampling.check_lane_count(len(p.inputs) * p.n, served.limits)
        sampling.check_lane(p.sampling, max_tokens, served.limits)
    except InvalidSampling as e:
        raise invalid(e, names) from e
    return dataclasses.replace(p, max_tokens=max_tokens)
