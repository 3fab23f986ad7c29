"""The whole request path with real parts: openai client / gRPC -> gateway -> capture ->
NATS JetStream -> readout workers -> CAS registry, all through the embedded stack."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import nats
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from capture_svc.batcher import bucket_width
from stateblock.model.vocab import NO_EOS
from stateblock.protocol.streams import BLOCKS_STREAM
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import capture_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = [f"copy: {'abcdefgh'[i % 8] * (1 + i % 13)}{i}" for i in range(50)]


@pytest.fixture(scope="module")
def http_url(stack) -> str:
    return stack.urls.http


@pytest.fixture(scope="module")
def client(http_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(http_url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def in_process_answer(
    serving_model, engine, prompt: str, max_tokens: int, ignore_eos: bool = False, **sampling
) -> list[int]:
    """The same prompt through capture + decoder in this process, padded like the service."""
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import sampling_params

    rows = serving_model.prompt_rows(prompt, pad_to=bucket_width)
    params = sampling_params(ignore_eos=ignore_eos, **sampling)
    (result,) = engine.readout([LaneRequest(rows=rows, depth=max_tokens, sampling=params)])
    return list(result.token_ids)


def test_models_health_metrics(client, http_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{http_url}/health").json()["status"] == "ok"
    text = httpx.get(f"{http_url}/metrics").text
    for name in (
        "plans_registered_total", "records_total", "consumed_total",
        "cross_request_events_total", "identity_mismatch_total", "lane_length_mismatch_total",
        "row_count_mismatch_total", "layout_digest_mismatch_total", "mode_mismatch_total",
        "double_consume_total", "unplanned_records_total", "expired_plans_total",
    ):  # fmt: skip
        assert f"stateblock_capture_{name}" in text
    assert "stateblock_capture_active_plans" in text
    assert "stateblock_readout_seconds" in text
    assert "# TYPE stateblock:e2e_request_latency_seconds histogram" in text


def test_completion_matches_the_in_process_decoder(client, serving_model, engine):
    r = client.completions.create(model=MODEL, prompt="copy: hello", max_tokens=24)
    (choice,) = r.choices
    expected = in_process_answer(serving_model, engine, "copy: hello", 24)
    assert choice.text == serving_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert r.usage.prompt_tokens == len(serving_model.tokenizer("copy: hello")["input_ids"])
    assert r.usage.completion_tokens == len(expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_sync_and_streaming_with_usage(client):
    messages = [{"role": "user", "content": "reverse: stateblock"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert (
        finishes[-1] == full.choices[0].finish_reason and finishes.count(None) == len(finishes) - 1
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


async def test_async_completion_and_stream(aclient):
    full = await aclient.completions.create(model=MODEL, prompt="sort: dcba", max_tokens=40)
    stream = await aclient.completions.create(
        model=MODEL,
        prompt="sort: dcba",
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "sort: dcba"}], max_tokens=40
    )
    # the chat template renders a lone user turn exactly like the raw prompt
    assert chat.choices[0].message.content == full.choices[0].text


async def test_concurrent_requests_each_get_their_own_answer(aclient):
    async def ask(prompt: str) -> tuple[str, str]:
        r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=32)
        return r.choices[0].text, r.choices[0].finish_reason

    alone = [await ask(p) for p in PROMPTS]
    assert len(set(alone)) > 1  # the prompts are told apart, so a mix-up would show
    together = await asyncio.gather(*(ask(p) for p in PROMPTS))
    assert together == alone


def test_n_choices_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=["copy: ab", "copy: cd"], n=2, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: the copies of one prompt agree
    one = client.completions.create(model=MODEL, prompt="copy: cd", max_tokens=8)
    assert r.choices[2].text == one.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = {"model": MODEL, "prompt": "count: 1 9", "max_tokens": 32, "temperature": 1.0}
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b


def test_default_max_tokens_reads_the_trained_depth(client):
    r = client.completions.create(model=MODEL, prompt="copy: x")
    # the random test decoder rarely says EOS: it reads to the manifest's max_answer
    assert r.usage.completion_tokens <= 4096
    assert r.choices[0].finish_reason in ("stop", "length")


def test_grpc_generate_stream_health_reflection(stack):
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(model=MODEL, prompt="copy: grpc", max_tokens=20)
        full = stub.Generate(req, timeout=30)
        (choice,) = full.choices
        assert choice.finish_reason in (
            gateway_pb2.FINISH_REASON_STOP,
            gateway_pb2.FINISH_REASON_LENGTH,
        )
        if choice.finish_reason == gateway_pb2.FINISH_REASON_LENGTH:
            assert choice.eos_pos == NO_EOS
        chunks = list(
            stub.GenerateStream(
                gateway_pb2.GenerateStreamRequest(request=req, include_usage=True), timeout=30
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        assert ids == list(choice.token_ids)
        assert chunks[-1].usage == full.usage and not chunks[-1].choices

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "stateblock.v1.Gateway"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for s in reply.list_services_response.service}
        assert "stateblock.v1.Gateway" in names
        # reflection v1 (grpcurl's first choice): v1alpha's messages on the v1 method path
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (reply,) = v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in reply.list_services_response.service}
        assert {"stateblock.v1.Gateway", "grpc.reflection.v1.ServerReflection"} <= names
        (reply,) = v1(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="stateblock.v1.Gateway")]))  # fmt: skip
        assert reply.file_descriptor_response.file_descriptor_proto


async def _path_state(nats_url: str) -> tuple[int, int]:
    """(blocks ever published, registry writes ever made): what a bad request must leave
    unchanged. Stream sequence numbers, not a key listing: any claim, commit or release
    moves the registry's sequence, and reading it needs no consumer."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        published = (await js.stream_info(BLOCKS_STREAM)).state.last_seq
        registry_writes = (await js.stream_info("KV_STATEBLOCK_REGISTRY")).state.last_seq
        return published, registry_writes
    finally:
        await nc.close()


BAD_HTTP = [
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8193}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": 123}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 9}, "n"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9000,
        },
        "max_completion_tokens",
    ),
]


def test_bad_inputs_get_clear_errors_and_leave_nothing_behind(stack, http_url):
    before = asyncio.run(_path_state(stack.urls.nats_admin))
    for path, body, param in BAD_HTTP:
        r = httpx.post(f"{http_url}{path}", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert error["message"]
    r = httpx.post(f"{http_url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for req in (
            gateway_pb2.GenerateRequest(model=MODEL, prompt=""),
            gateway_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=9000),
            gateway_pb2.GenerateRequest(model=MODEL, prompt="x" * 5000),
            gateway_pb2.GenerateRequest(
                model=MODEL,
                prompt="hi",
                messages=[capture_pb2.ChatMessage(role="user", content="x")],
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(req, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details()
    assert asyncio.run(_path_state(stack.urls.nats_admin)) == before
    metrics = httpx.get(f"{http_url}/metrics").text
    assert "stateblock_capture_active_plans 0.0" in metrics


def test_openai_client_raises_bad_request(client, stack):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=9000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(model="nope", prompt="hi"), timeout=30
            )
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND


def test_openai_client_stops_and_refusals(client):
    """Through the official client: a stop string cuts the answer (sync and streaming),
    an unsupported parameter is a BadRequestError naming it."""
    full = client.completions.create(model=MODEL, prompt="copy: hello", max_tokens=8).choices[0]
    if len(full.text) >= 3:
        stop = full.text[1:3]
        cut = client.completions.create(model=MODEL, prompt="copy: hello", max_tokens=8, stop=stop)
        assert cut.choices[0].text == full.text[: full.text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"
        stream = client.completions.create(
            model=MODEL, prompt="copy: hello", max_tokens=8, stop=[stop], stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == cut.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", top_p=0.0)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", logit_bias={"5": 3})
    assert info.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], frequency_penalty=1.0
        )
    assert info.value.body["param"] == "frequency_penalty"


def test_cli_ask_and_keys_generate(stack, client, capsys, tmp_path):
    from stateblock.app.cli import main
    from stateblock.protocol.keys import Signer, TrustStore

    messages = [{"role": "user", "content": "copy: cli"}]
    expected = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert main(["ask", "copy: cli", "--url", stack.urls.http, "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out == expected.choices[0].message.content + "\n"
    assert main(["ask", "hi", "--url", stack.urls.http, "--max-tokens", "9000"]) == 1
    assert "error 400" in capsys.readouterr().err

    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert Signer.load(Path(info["private"])).key_id == info["key_id"]
    assert info["key_id"] in TrustStore.from_dir(tmp_path)


def test_throughput_bench_load_answers_every_request(stack):
    """bench.throughput_cpu's load generator against the real stack: every request of the
    run is answered (a failed one raises) and timed once."""
    from bench.throughput_cpu import run_load

    body = {"model": MODEL, "prompt": "copy: hi", "max_tokens": 8}
    wall, latencies = run_load(stack.urls.http, body, n=7, concurrency=3)
    assert len(latencies) == 7 and all(0 < t <= wall for t in latencies)


def test_ignore_eos_reads_every_position_over_http_and_grpc(client, stack, serving_model, engine):
    """vLLM's `ignore_eos` (an extra body field for the openai client; a request field in
    gRPC): all max_tokens positions come back, finish "length", no EOS position."""
    r = client.completions.create(
        model=MODEL, prompt="copy: hello", max_tokens=24, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    expected = in_process_answer(serving_model, engine, "copy: hello", 24, ignore_eos=True)
    assert len(expected) == 24
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            model=MODEL, prompt="copy: hello", max_tokens=24, ignore_eos=True
        )
        (choice,) = stub.Generate(req, timeout=30).choices
    assert list(choice.token_ids) == expected
    assert choice.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and choice.eos_pos == NO_EOS
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "copy: hello"}],
        max_tokens=17,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 17 and chat.choices[0].finish_reason == "length"


def test_a_retry_with_the_same_idempotency_key_never_runs_twice(stack, http_url):
    """Through the real stack (the key store is a JetStream KV bucket): the same key twice
    gives the first answer, with no second block captured; gRPC metadata carries it too."""
    body = {"model": MODEL, "prompt": "copy: idem", "max_tokens": 6, "temperature": 1.0}
    headers = {"Idempotency-Key": "retry-7f3"}

    def plans() -> float:
        text = httpx.get(f"{http_url}/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "stateblock_capture_plans_registered_total":
                    return sample.value
        raise AssertionError("no plan counter")

    before = plans()
    first = httpx.post(f"{http_url}/v1/completions", json=body, headers=headers, timeout=30)
    again = httpx.post(f"{http_url}/v1/completions", json=body, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["choices"] == first.json()["choices"]  # sampled, yet the same
    assert plans() == before + 1
    other = httpx.post(
        f"{http_url}/v1/completions", json={**body, "max_tokens": 5}, headers=headers, timeout=30
    )
    assert other.status_code == 400
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(model=MODEL, prompt="copy: grpc", max_tokens=4)
        a = stub.Generate(req, metadata=(("idempotency-key", "g-1"),), timeout=30)
        b = stub.Generate(req, metadata=(("idempotency-key", "g-1"),), timeout=30)
    assert a.request_id == b.request_id


def test_a_prompt_as_token_ids_reads_as_its_text(client, http_url, stack):
    """OpenAI's prompt as token ids (and gRPC's prompt_token_ids): the capture reads them as
    given, so /tokenize's ids of a text answer as the text does; ids outside the vocabulary
    are a 400 naming the prompt."""
    ids = httpx.post(f"{http_url}/tokenize", json={"prompt": "copy: hello"}).json()["tokens"]
    text = client.completions.create(model=MODEL, prompt="copy: hello", max_tokens=8)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    assert as_ids.choices[0].text == text.choices[0].text
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(model=MODEL, prompt_token_ids=ids, max_tokens=8)
        assert stub.Generate(req, timeout=30).choices[0].text == text.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 99999], max_tokens=8)
    assert info.value.body["param"] == "prompt" and "vocabulary" in info.value.body["message"]


async def test_sampling_filters_and_echo_through_the_openai_client(
    client, aclient, serving_model, engine
):
    """top_k / min_p / min_tokens (vLLM's extra fields) and top_p / echo (OpenAI's) are
    applied by the readout: the served answer equals the in-process engine's with the same
    params, a one-candidate filter at temperature 1.5 is the greedy answer, and min_tokens
    holds EOS back (sync, async and streaming)."""
    decode = serving_model.tokenizer.decode
    prompt = "copy: hello"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.5,
                                      seed=3, extra_body=extra)  # fmt: skip
        assert r.choices[0].text == greedy, extra
    tiny = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.5,
                                     seed=3, top_p=1e-6)  # fmt: skip
    assert tiny.choices[0].text == greedy
    want = in_process_answer(serving_model, engine, prompt, 40, min_tokens=30)
    r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                         extra_body={"min_tokens": 30})  # fmt: skip
    assert r.choices[0].text == decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(want) >= 30
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, echo=True,
                                       stream=True, extra_body={"min_tokens": 30})  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == prompt + r.choices[0].text
    sampled = dict(temperature=1.0, seed=11, top_p=0.9)
    want = in_process_answer(serving_model, engine, prompt, 40, seed=11, temperature=1.0,
                             top_k=4, top_p=0.9, min_p=0.05)  # fmt: skip
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **sampled,
                                  extra_body={"top_k": 4, "min_p": 0.05})  # fmt: skip
    assert r.choices[0].text == decode(want, skip_special_tokens=True)


async def test_exact_logprobs_through_every_api(client, aclient, stack, serving_model, engine):
    """The worker's exact log-probabilities reach the client unchanged: completions
    (sync), chat (async streaming) and gRPC carry the in-process engine's values."""
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import sampling_params

    prompt = "copy: hello"
    rows = serving_model.prompt_rows(prompt, pad_to=bucket_width)
    (want,) = engine.readout(
        [LaneRequest(rows=rows, depth=12, sampling=sampling_params(logprobs=2))]
    )
    n = len(want.token_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(list(want.logprobs.token[:n]), abs=1e-5)
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx(
        list(want.logprobs.top1[:n]), abs=1e-5
    )
    assert all(-60 < x <= 0 for x in lp.token_logprobs)
    chunks = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
        logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    content = [c for chunk in [x async for x in chunks] if chunk.choices and chunk.choices[0].logprobs
               for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert content and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            model=MODEL, prompt=prompt, max_tokens=12, sampling=sampling_params(logprobs=1)
        )
        (choice,) = stub.Generate(req, timeout=30).choices
    assert [t.token_id for t in choice.logprobs] == list(want.token_ids)
    assert [t.logprob for t in choice.logprobs] == pytest.approx(
        list(want.logprobs.token[:n]), abs=1e-5
    )
    assert all(len(t.top_ids) == 1 for t in choice.logprobs)
