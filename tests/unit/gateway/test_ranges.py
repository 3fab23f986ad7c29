"""Every integer of every request is range-checked before a tokenizer or a tensor sees it:
an out-of-range one is a 400 naming its field (gRPC: INVALID_ARGUMENT), and random JSON at
every HTTP endpoint never gets a 5xx."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.grpc_server import serve_grpc
from gateway.http import create_app
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.unit.gateway.conftest import MODEL

BIG = 1 << 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}
COMPLETION = {"model": MODEL, "prompt": "a"}
OUT_OF_RANGE = [
    ("/v1/completions", {"model": MODEL, "prompt": [BIG]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, -1]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [1, BIG]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "echo": True, "prompt": [1 << 40]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "n": BIG}, "n"),
    ("/v1/completions", {**COMPLETION, "n": -BIG}, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": BIG}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "seed": BIG}, "seed"),
    ("/v1/completions", {**COMPLETION, "top_k": BIG}, "top_k"),
    ("/v1/completions", {**COMPLETION, "logprobs": BIG}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "min_tokens": BIG}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "best_of": BIG}, "best_of"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "seed": -BIG}, "seed"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [1 << 33]}, "stop_token_ids"),
    ("/detokenize", {"tokens": [999999, -1]}, "tokens"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
    ("/detokenize", {"tokens": [1 << 40]}, "tokens"),
]


@pytest.fixture
async def http(service, metrics):
    app = create_app(service, metrics=metrics, created=1)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


@pytest.mark.parametrize(("path", "body", "param"), OUT_OF_RANGE)
async def test_an_out_of_range_integer_is_a_400_naming_its_field(http, fakes, path, body, param):
    capture, _ = fakes
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert capture.calls == []


async def test_token_ids_in_the_vocabulary_are_served(http, fakes, service):
    capture, _ = fakes
    top = service.vocab_size - 1
    r = await http.post("/detokenize", json={"tokens": [0, top]})
    assert r.status_code == 200, r.text
    r = await http.post("/v1/completions", json={**COMPLETION, "prompt": [0, top], "echo": True})
    assert r.status_code == 200, r.text
    assert list(capture.calls[0][2][0].tokens.ids) == [0, top]


@pytest.mark.parametrize(
    "request_fields", [{"prompt_token_ids": [999999]}, {"prompt": "a", "stop_token_ids": [1 << 31]}]
)
async def test_grpc_token_ids_outside_the_vocabulary_are_invalid_argument(
    service, fakes, request_fields
):
    capture, _ = fakes
    async with serve_grpc(service, "127.0.0.1", 0, 1.0) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(
                    gateway_pb2.GenerateRequest(model=MODEL, **request_fields), timeout=5
                )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in info.value.details()
    assert capture.calls == []


# -- random JSON at every endpoint ------------------------------------------------------------

INTS = st.one_of(
    st.integers(-3, 70),
    st.integers(),
    st.sampled_from([-(1 << 64), -(1 << 63) - 1, (1 << 31), (1 << 32), (1 << 63), 1 << 64]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(),
    st.text(max_size=12),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
SAMPLING = [
    "n", "max_tokens", "seed", "top_k", "top_p", "min_p", "min_tokens", "logprobs", "stop",
    "stop_token_ids", "temperature", "stream", "stream_options", "ignore_eos",
]  # fmt: skip
# each endpoint: a valid body, and the fields whose values are thrown at it
ENDPOINTS = {
    "/v1/completions": (COMPLETION, [*SAMPLING, "prompt", "best_of", "echo"]),
    "/v1/chat/completions": (
        CHAT,
        [*SAMPLING, "messages", "max_completion_tokens", "top_logprobs", "logprobs"],
    ),
    "/tokenize": ({"prompt": "a"}, ["prompt", "add_special_tokens"]),
    "/detokenize": ({"tokens": [1]}, ["tokens"]),
}
GETS = ["/health", "/metrics", "/v1/models", "/version"]
FIELD_VALUES = st.one_of(
    INTS,
    st.lists(INTS, min_size=1, max_size=4),
    st.lists(st.lists(INTS, min_size=1, max_size=3), min_size=1, max_size=3),
    JSON,
    st.lists(st.fixed_dictionaries({"role": JSON, "content": JSON}), max_size=2),
)


@st.composite
def bodies(draw) -> tuple[str, object]:
    """An endpoint and either any JSON, or its valid body with some fields set to anything
    (which reaches past the first type check)."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    if draw(st.integers(0, 3)) == 0:
        return path, draw(JSON)
    changes = draw(st.dictionaries(st.sampled_from(fields), FIELD_VALUES, min_size=1, max_size=2))
    return path, {**base, **changes}


@pytest.fixture
def sync_http(service, metrics):
    app = create_app(service, metrics=metrics, created=1)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=bodies(), get=st.sampled_from(GETS))
def test_random_json_at_every_endpoint_is_never_a_5xx(sync_http, request, get):
    path, body = request
    # json.dumps writes NaN and Infinity as Python's json module reads them: a client may too
    content = json.dumps(body).encode()
    r = sync_http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    r = sync_http.request("GET", get, content=content)
    assert r.status_code < 500, (get, r.text)
