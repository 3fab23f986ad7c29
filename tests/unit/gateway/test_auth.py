"""--api-key on both transports: the API needs `Bearer <key>`, probes stay open. The gRPC
half runs a real gRPC server on port 0 over the fake capture and commit source."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from gateway.grpc_server import serve_grpc
from gateway.http import create_app
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.unit.gateway.conftest import MODEL

KEY = "sk-test-key"


@pytest.fixture
async def http(service):
    app = create_app(service, metrics=CollectorRegistry(), created=1, api_key=KEY)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


@pytest.mark.parametrize("header", [None, "Bearer wrong", KEY, "Basic sk-test-key"])
async def test_the_api_needs_the_key(http, fakes, header):
    capture, _ = fakes
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        r = await http.request(method, path, headers=headers, json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert capture.calls == []


async def test_the_key_opens_the_api_and_probes_need_none(http):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = await http.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 200, r.text
    for path in ("/health", "/metrics", "/version"):
        assert (await http.get(path)).status_code == 200, path


async def test_grpc_needs_the_key_in_metadata(service):
    async with serve_grpc(service, "127.0.0.1", 0, 1.0, api_key=KEY) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            req = gateway_pb2.GenerateRequest(model=MODEL, prompt="a")
            for metadata in ((), (("authorization", "Bearer nope"),)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(req, metadata=metadata, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    stream = stub.GenerateStream(
                        gateway_pb2.GenerateStreamRequest(request=req), metadata=metadata
                    )
                    async for _ in stream:
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=5)
            assert ok.choices
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
