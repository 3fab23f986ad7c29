"""The gateway's edges without a network: each error translated once (OpenAI body, gRPC
status, the capture client's reading of gRPC errors), the gRPC request mapping, and the
HTTP app in process (ASGI) over a fake capture and commit source."""

from __future__ import annotations

import functools
import json

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.capture_client import PARAM_METADATA, translate
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ReadoutFailed,
    Unavailable,
)
from gateway.grpc_server import params_of, status_of
from gateway.http import create_app
from gateway.openai.errors import openai_error
from stateblock.nats_client import NatsState, Readiness
from stateblock.v1 import capture_pb2, gateway_pb2
from tests.unit.gateway.conftest import DEFAULT_MAX_TOKENS, MODEL

ERRORS = [
    (InvalidRequest("bad n", "n"), 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    (DeadlineExceeded("late"), 504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unavailable("down"), 503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE),
    (ReadoutFailed("digest"), 500, "server_error", grpc.StatusCode.INTERNAL),
    (GatewayError("other"), 500, "server_error", grpc.StatusCode.UNKNOWN),
]


@pytest.mark.parametrize(("error", "status", "kind", "code"), ERRORS)
def test_every_error_is_translated_once_per_edge(error, status, kind, code):
    got_status, body = openai_error(error)
    assert (got_status, body.error.type) == (status, kind)
    assert body.error.message == str(error)
    assert status_of(error) == code


def test_an_invalid_request_names_its_parameter():
    _, body = openai_error(InvalidRequest("no such model", "model", "model_not_found"))
    assert (body.error.param, body.error.code) == ("model", "model_not_found")


def _rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, ReadoutFailed),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable),
    ],
)
def test_capture_errors_become_gateway_errors(code, expected):
    error = translate(_rpc_error(code, "why", [(PARAM_METADATA, "prompt")]))
    assert type(error) is expected and "why" in str(error)
    if expected is InvalidRequest:
        assert error.param == "prompt"


def test_grpc_requests_map_to_one_sampling_type(service):
    p = params_of(
        gateway_pb2.GenerateRequest(
            model=MODEL, prompt="copy: a", max_tokens=5, temperature=0.5, seed=3, n=2,
            ignore_eos=True,
        ),
        service,
    )  # fmt: skip
    assert (p.n, p.max_tokens) == (2, 5)
    assert (p.sampling.temperature, p.sampling.seed, p.sampling.ignore_eos) == (0.5, 3, True)
    unset = params_of(gateway_pb2.GenerateRequest(model=MODEL, prompt="x"), service)
    assert unset.max_tokens == DEFAULT_MAX_TOKENS and not unset.sampling.HasField("seed")
    with pytest.raises(InvalidRequest):
        params_of(
            gateway_pb2.GenerateRequest(
                model=MODEL, prompt="x", messages=[capture_pb2.ChatMessage(role="user")]
            ),
            service,
        )


@pytest.fixture
async def http(service):
    app = create_app(service, metrics=CollectorRegistry(), created=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def test_completions_over_http(http, fakes, detokenizer):
    capture, _ = fakes
    r = await http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 6, "seed": 1, "temperature": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == detokenizer.decode([20, 21, 22])
    (_, _, lanes) = capture.calls[0]
    assert [lane.prompt for lane in lanes] == ["a", "b"]
    assert [lane.max_tokens for lane in lanes] == [6, 6]
    assert body["usage"]["prompt_tokens"] == 6


async def test_chat_max_completion_tokens_names_itself_in_errors(http):
    r = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 10_000,
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_completion_tokens"


async def test_a_streamed_completion_ends_with_done(http):
    async with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "a",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL, "prompt": "a", "seed": -1}, "seed"),
        ({"model": MODEL, "prompt": "a", "temperature": 3}, "temperature"),
    ],
)
async def test_bad_http_requests_get_openai_error_bodies(http, fakes, body, param):
    capture, _ = fakes
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == param
    assert capture.calls == []


async def test_capture_outage_is_503_in_openai_shape(http, fakes):
    capture, _ = fakes
    capture.error = Unavailable("capture service unavailable")
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


@pytest.fixture
async def small_http(service):
    app = create_app(service, metrics=CollectorRegistry(), created=1, max_body_bytes=4096)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def test_a_body_over_the_limit_is_413_unread(small_http, fakes):
    capture, _ = fakes
    body = {"model": MODEL, "prompt": "a" * 5000}
    r = await small_http.post("/v1/completions", json=body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunks():  # no Content-Length: counted as it streams in
        yield b'{"model": "test-model", "prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    r = await small_http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert capture.calls == []


async def test_a_lone_surrogate_is_400_not_500(http, fakes):
    capture, _ = fakes
    raw = b'{"model": "test-model", "prompt": "copy: \\ud800"}'
    r = await http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "Unicode" in r.json()["error"]["message"]
    chat = b'{"model": "test-model", "messages": [{"role": "user", "content": "\\udfff"}]}'
    r = await http.post(
        "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert capture.calls == []


async def test_a_prompt_longer_than_any_allowed_is_refused_before_tokenising(service, fakes):
    capture, _ = fakes
    too_long = "a" * (service._config.limits.prompt_chars_max + 1)
    with pytest.raises(InvalidRequest, match="characters"):
        await service.generate(params_of_prompt(too_long), api="test")
    assert capture.calls == []


def params_of_prompt(prompt: str):
    from gateway.params import GenerateParams, PromptSpec, check

    return functools.partial(
        check, GenerateParams(model=MODEL, inputs=(PromptSpec(prompt=prompt),))
    )


async def test_health_follows_readiness_and_says_why(service):
    """/health is 503 naming what does not answer while a probe fails, and 200 again
    once it answers; a NATS disconnect counts too."""
    state = NatsState("t", connected=True)
    readiness = Readiness(state)
    app = create_app(service, metrics=CollectorRegistry(), created=1, readiness=readiness)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        assert (await http.get("/health")).status_code == 200
        await readiness.report("capture", "no answer within 2s")
        r = await http.get("/health")
        assert r.status_code == 503 and "capture: no answer within 2s" in r.json()["why"]
        await state.set(False)
        await readiness.report("capture", None)
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["why"] == "nats: disconnected"
        await state.set(True)
        assert (await http.get("/health")).status_code == 200
