"""The OpenAI layer's parts (gateway/openai): each family's router and to_params, and the one
renderer both APIs' responses and streams go through."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway import protocol as p
from gateway.errors import InvalidRequest
from gateway.http import create_app
from gateway.openai import chat, completions, models, tokenize
from tests.unit.gateway.conftest import MODEL

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def http(service):
    app = create_app(service, metrics=CollectorRegistry(), created=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


def test_each_family_attaches_its_own_routes(service):
    app = create_app(service, metrics=CollectorRegistry(), created=1)
    served = set(app.openapi()["paths"])
    by_family = {
        family: {route.path for route in family.router.routes}
        for family in (models, tokenize, completions, chat)
    }
    assert by_family[completions] == {"/v1/completions"}
    assert by_family[chat] == {"/v1/chat/completions"}
    assert by_family[tokenize] == {"/tokenize", "/detokenize"}
    assert by_family[models] == {"/v1/models", "/version", "/health", "/metrics"}
    assert set().union(*by_family.values()) == served


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"max_completion_tokens": 4, "max_tokens": 10_000}, None),
    ],
)
def test_chat_to_params_names_the_depth_field_the_request_used(service, fields, param):
    req = p.ChatCompletionRequest(model=MODEL, messages=MESSAGES, **fields)
    if param is None:
        assert chat.to_params(req, service).max_tokens == 4
        return
    with pytest.raises(InvalidRequest) as e:
        chat.to_params(req, service)
    assert e.value.param == param


def test_to_params_refuses_by_the_requests_field(service):
    with pytest.raises(InvalidRequest) as e:
        chat.to_params(
            p.ChatCompletionRequest(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=9),
            service,
        )
    assert e.value.param == "top_logprobs"
    with pytest.raises(InvalidRequest) as e:
        completions.to_params(p.CompletionRequest(model=MODEL, prompt="a", logprobs=9), service)
    assert e.value.param == "logprobs"


async def _stream(http, url: str, body: dict) -> list[dict]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize(
    ("url", "body", "prefix", "text_of"),
    [
        ("/v1/completions", {"prompt": "a"}, "cmpl-", lambda c: c.get("text") or ""),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES},
            "chatcmpl-",
            lambda c: c.get("delta", {}).get("content") or "",
        ),  # fmt: skip
    ],
)
async def test_both_apis_render_alike_whole_and_streamed(http, url, body, prefix, text_of):
    whole = (await http.post(url, json={"model": MODEL, "n": 2, **body})).json()
    chunks = await _stream(http, url, {"model": MODEL, "n": 2, **body})
    (rid,) = {c["id"] for c in chunks}
    assert rid.startswith(prefix) and whole["id"].startswith(prefix)
    assert {c["system_fingerprint"] for c in chunks} == {"fp_test"}
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    for choice in whole["choices"]:
        i = choice["index"]
        mine = [c["choices"][0] for c in answer if c["choices"][0]["index"] == i]
        streamed = "".join(text_of(c) for c in mine)
        assert streamed == (choice.get("text") or choice.get("message", {}).get("content"))
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
