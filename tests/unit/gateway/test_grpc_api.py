"""The gRPC API a vLLM user expects, on a real gRPC server (port 0) over the fake capture
and commit source: the shared SamplingParams, stops, token-id prompts, the client's request
id, GetModelInfo."""

from __future__ import annotations

import grpc
import pytest

from gateway.grpc_server import serve_grpc
from stateblock.v1 import block_pb2, gateway_pb2, gateway_pb2_grpc
from tests.unit.gateway.conftest import DEFAULT_MAX_TOKENS, MODEL


@pytest.fixture
async def stub(service):
    async with serve_grpc(service, "127.0.0.1", 0, 1.0) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel)


async def test_model_info(stub, service):
    info = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
    assert info.model == MODEL and info.default_max_tokens == DEFAULT_MAX_TOKENS
    assert info.answer_depth_max == service.limits.answer_depth_max
    assert info.max_lanes == service.limits.max_lanes


async def test_the_shared_sampling_type_and_the_client_request_id(stub, fakes):
    capture, _ = fakes
    sampling = block_pb2.SamplingParams(temperature=0.5, seed=11, ignore_eos=True)
    req = gateway_pb2.GenerateRequest(
        model=MODEL, prompt="copy: ab", sampling=sampling, temperature=1.9, request_id="client-42"
    )
    reply = await stub.Generate(req, timeout=5)
    assert reply.client_request_id == "client-42" and reply.request_id != "client-42"
    (_, _, (lane,)) = capture.calls[0]
    assert lane.sampling == sampling  # the message replaces the flat fields


async def test_token_id_prompts_and_stops(stub, fakes):
    capture, commits = fakes
    commits.answers = [[20, 21, 22, 23]]
    req = gateway_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=[1, 5, 9, 4], stop_token_ids=[22]
    )
    reply = await stub.Generate(req, timeout=5)
    (_, _, (lane,)) = capture.calls[0]
    assert lane.WhichOneof("input") == "tokens" and list(lane.tokens.ids) == [1, 5, 9, 4]
    (choice,) = reply.choices
    assert list(choice.token_ids) == [20, 21] and choice.stop_token_id == 22
    assert choice.finish_reason == gateway_pb2.FINISH_REASON_STOP
    stream = stub.GenerateStream(
        gateway_pb2.GenerateStreamRequest(
            request=gateway_pb2.GenerateRequest(model=MODEL, prompt="a", stop=["\\u0000never"])
        )
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].WhichOneof("stop_reason") is None  # EOS, not a stop
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(
            gateway_pb2.GenerateRequest(model=MODEL, prompt="a", prompt_token_ids=[1]), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_undecodable_requests_are_invalid_argument(service):
    """Bytes that are not the method's message: INVALID_ARGUMENT naming the parse error,
    for unary and streaming calls alike (grpc's own answer is UNKNOWN)."""
    async with serve_grpc(service, "127.0.0.1", 0, 1.0) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, call in (
                ("Generate", channel.unary_unary),
                ("GenerateStream", channel.unary_stream),
            ):
                raw = call(f"/stateblock.v1.Gateway/{method}")  # bytes in, bytes out
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    reply = raw(b"\xff\xff\xff garbage", timeout=5)
                    if method == "GenerateStream":
                        async for _ in reply:
                            pass
                    else:
                        await reply
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                assert "undecodable" in info.value.details()
            ok = await gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(model=MODEL, prompt="a"), timeout=5
            )
            assert ok.choices
