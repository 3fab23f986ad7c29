"""What a vLLM user expects of the OpenAI API, through the HTTP app in process over a fake
capture and commit source: refusals out loud, stops, roles, conformance, metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http import create_app
from tests.unit.gateway.conftest import MODEL


@pytest.fixture
async def http(service, metrics):
    app = create_app(service, metrics=metrics, created=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


REFUSED = [
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1),
    ("repetition_penalty", 1.2),
    ("logit_bias", {"5": 10}),
    ("suffix", "x"),
    ("best_of", 3),
    ("response_format", {"type": "json_object"}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f for f, _ in REFUSED])
async def test_what_a_readout_cannot_honour_is_refused_by_name(http, fakes, field, value):
    capture, _ = fakes
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert field in error["message"] and "not supported: " in error["message"]
    assert capture.calls == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 1), ("frequency_penalty", 0), ("best_of", 1), ("logprobs", None), ("echo", False)],
)
async def test_default_values_of_those_fields_are_served(http, field, value):
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
     ("top_logprobs", 1)],  # top_logprobs without logprobs: true
)  # fmt: skip
async def test_chat_refuses_tools_and_lone_top_logprobs(http, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.parametrize("role", ["wizard", "tool", "function"])
async def test_an_unknown_chat_role_is_400(http, role):
    body = {"model": MODEL, "messages": [{"role": role, "content": "hi"}]}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert role in r.json()["error"]["message"]


async def test_unknown_fields_are_accepted(http):
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "foo": 1})
    assert r.status_code == 200


async def test_stop_strings_cut_the_answer_and_name_the_match(http, fakes, detokenizer):
    _, commits = fakes
    commits.answers = [list(range(5, 25))]
    full = detokenizer.decode(list(range(5, 25)))
    stop = full[6:8]
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stop": [stop]})
    (choice,) = r.json()["choices"]
    assert choice["text"] == full[: full.find(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    body = {"model": MODEL, "prompt": "a", "stop": stop, "include_stop_str_in_output": True}
    r = await http.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == full[: full.find(stop) + len(stop)]


async def test_a_stream_never_emits_text_past_a_stop(http, fakes, detokenizer):
    _, commits = fakes
    commits.answers = [list(range(5, 45))]
    full = detokenizer.decode(list(range(5, 45)))
    stop = full[20:22]
    body = {"model": MODEL, "prompt": "a", "stop": stop, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full[: full.find(stop)]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


async def test_stop_token_ids_end_the_answer_before_the_token(http, fakes):
    _, commits = fakes
    commits.answers = [[20, 21, 22, 23]]
    body = {"model": MODEL, "prompt": "a", "stop_token_ids": [22]}
    (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    assert choice["stop_reason"] == 22 and choice["finish_reason"] == "stop"
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stop": [""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


async def test_chat_stop_and_fingerprint(http, fakes, detokenizer):
    _, commits = fakes
    commits.answers = [[20, 21, 22, 23]]
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "stop_token_ids": [23],
    }
    r = (await http.post("/v1/chat/completions", json=body)).json()
    assert r["system_fingerprint"] == "fp_test"
    assert r["choices"][0]["message"]["content"] == detokenizer.decode([20, 21, 22])
    assert r["choices"][0]["stop_reason"] == 23


async def test_an_unknown_model_is_404_model_not_found(http):
    r = await http.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)],
)
async def test_every_error_body_has_the_openai_shape(http, method, path, status):
    r = await http.request(method, path)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and r.json()["error"]["message"]


async def test_malformed_json_is_400_in_the_openai_shape(http):
    r = await http.post(
        "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_models_version_tokenize_detokenize(http, service, detokenizer):
    (card,) = (await http.get("/v1/models")).json()["data"]
    limits = service.limits
    assert card["max_model_len"] == limits.prompt_len_max + limits.answer_depth_max
    assert card["max_answer_tokens"] == limits.answer_depth_max
    assert (await http.get("/version")).json()["version"]
    t = (await http.post("/tokenize", json={"model": MODEL, "prompt": "copy: ab"})).json()
    assert t["tokens"] == detokenizer.encode("copy: ab") and t["count"] == len(t["tokens"])
    d = (await http.post("/detokenize", json={"tokens": t["tokens"]})).json()
    assert d["prompt"] == detokenizer.decode(t["tokens"])
    r = await http.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404


async def test_metrics_in_vllm_names_parse_and_count_failures(http, metrics):
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 10_000})
    text = (await http.get("/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name, **labels):
        return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))))

    assert value("stateblock:e2e_request_latency_seconds_count", outcome="ok") == 1
    assert value("stateblock:e2e_request_latency_seconds_count", outcome="InvalidRequest") == 1
    assert value("stateblock:prompt_tokens_total") == 3
    assert value("stateblock:generation_tokens_total") == 3
    assert value("stateblock:request_success_total", finished_reason="stop") == 1
    assert value("stateblock:num_requests_running") == 0
    assert value("stateblock:time_to_first_token_seconds_count") == 1
    assert any(name.startswith("process_") for name, _ in samples)


async def test_prompts_as_token_ids(http, fakes):
    capture, _ = fakes
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 5, 9]})
    assert r.status_code == 200, r.text
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 5], [1, 6]]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1  # the fake answers one lane
    lanes = [lane for _, _, ls in capture.calls for lane in ls]
    assert [list(lane.tokens.ids) for lane in lanes] == [[1, 5, 9], [1, 5], [1, 6]]
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [-3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_sampling_filters_reach_the_signed_lanes(http, fakes):
    """top_k / top_p / min_p / min_tokens travel in the lanes' SamplingParams (what the
    block header signs and every engine applies); out-of-range values are 400 by name."""
    capture, _ = fakes
    body = {"model": MODEL, "prompt": "a", "temperature": 0.8, "top_k": 3, "top_p": 0.5,
            "min_p": 0.1, "min_tokens": 2, "max_tokens": 9}  # fmt: skip
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (lane,) = capture.calls[-1][2]
    s = lane.sampling
    assert (s.top_k, s.min_tokens) == (3, 2) and s.HasField("top_p")
    assert abs(s.top_p - 0.5) < 1e-6 and abs(s.min_p - 0.1) < 1e-6
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": -1,
            "top_p": 1.0}  # fmt: skip
    assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
    (lane,) = capture.calls[-1][2]
    assert lane.sampling.top_k == 0  # -1 is vLLM's "all", as 0
    for field, value in [("top_k", 9), ("top_k", -2), ("top_p", 0), ("top_p", 1.5),
                         ("min_p", -0.1), ("min_p", 2), ("min_tokens", 10), ("min_tokens", -1)]:  # fmt: skip
        r = await http.post("/v1/completions", json={**body, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, (field, value)


async def test_echo_puts_the_prompt_before_each_choice(http, fakes, detokenizer):
    _, commits = fakes
    commits.answers = [[20, 21, 22]]
    answer = detokenizer.decode([20, 21, 22])
    body = {"model": MODEL, "prompt": "copy: ab", "echo": True}
    (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    assert choice["text"] == "copy: ab" + answer
    body = {**body, "prompt": [20, 21], "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert chunks[0]["choices"][0]["text"] == detokenizer.decode([20, 21])  # the prompt first
    assert "".join(c["choices"][0]["text"] for c in chunks) == detokenizer.decode([20, 21]) + answer


async def test_logprobs_in_both_shapes_cut_with_the_answer(http, fakes, detokenizer):
    """Completions' legacy object and chat's content list carry each returned token's
    log-probability and the top candidates' (up to 2); a stop cuts them with the tokens;
    more than 2 is 400 naming the field; echo with logprobs is 400 (no prompt logprobs)."""
    from tests.unit.gateway.conftest import fake_logprob

    _, commits = fakes
    commits.answers = [[20, 21, 22, 23]]
    body = {"model": MODEL, "prompt": "a", "logprobs": 2}
    (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [detokenizer.decode([t]) for t in [20, 21, 22, 23]]
    assert lp["token_logprobs"] == pytest.approx([fake_logprob(j) for j in range(4)])
    assert len(lp["top_logprobs"]) == 4 and len(lp["top_logprobs"][0]) == 2
    assert lp["top_logprobs"][1][detokenizer.decode([22])] == pytest.approx(fake_logprob(1) - 1)
    assert lp["text_offset"] == [0, 1, 2, 3] and choice["text"] == "".join(lp["tokens"])
    body = {"model": MODEL, "prompt": "a", "logprobs": 0, "stop_token_ids": [22]}
    (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    assert len(choice["logprobs"]["tokens"]) == 2 and choice["logprobs"]["top_logprobs"] == [{}, {}]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 1}  # fmt: skip
    (choice,) = (await http.post("/v1/chat/completions", json=chat)).json()["choices"]
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([fake_logprob(j) for j in range(4)])
    assert [len(c["top_logprobs"]) for c in content] == [1] * 4
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    streamed = [c for line in lines for ch in json.loads(line[6:])["choices"]
                if ch.get("logprobs") for c in ch["logprobs"]["content"]]  # fmt: skip
    assert streamed == content
    for url, extra, param in [("/v1/completions", {"prompt": "a", "logprobs": 3}, "logprobs"),
                              ("/v1/chat/completions", {**chat, "top_logprobs": 5}, "top_logprobs"),
                              ("/v1/completions", {"prompt": "a", "logprobs": 1, "echo": True}, "echo")]:  # fmt: skip
        r = await http.post(url, json={"model": MODEL, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_a_bug_still_answers_in_the_openai_shape(service, metrics, fakes):
    """An exception nothing translated (here the capture raising a plain RuntimeError) is a
    500 in the OpenAI shape, with no traceback in the body."""
    capture, _ = fakes
    capture.error = RuntimeError("boom with a secret detail")
    app = create_app(service, metrics=metrics, created=1)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "secret" not in r.text
