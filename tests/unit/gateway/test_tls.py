"""TLS on the gateway's listeners with a certificate generated here: real handshakes over
HTTP (httpx) and gRPC; a plaintext client gets nothing."""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig
from gateway.grpc_server import serve_grpc
from gateway.http import create_app, serve_http
from stateblock.runtime import ConfigError
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import self_signed


@pytest.fixture(scope="module")
def cert_files(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


async def test_https(service, cert_files):
    app = create_app(service, metrics=CollectorRegistry(), created=1)
    async with serve_http(app, "127.0.0.1", 0, 1.0, tls=cert_files) as port:
        async with httpx.AsyncClient(verify=str(cert_files[0])) as client:
            r = await client.get(f"https://127.0.0.1:{port}/version")
            assert r.status_code == 200
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{port}/version", timeout=5)


async def test_grpc_over_tls(service, cert_files):
    async with serve_grpc(service, "127.0.0.1", 0, 1.0, tls=cert_files) as port:
        creds = grpc.ssl_channel_credentials(root_certificates=cert_files[0].read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            info = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
            assert info.model
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await gateway_pb2_grpc.GatewayStub(channel).GetModelInfo(
                    gateway_pb2.GetModelInfoRequest(), timeout=3
                )


def test_tls_files_go_together_and_must_exist(cert_files, tmp_path):
    with pytest.raises(ConfigError, match="go together"):
        GatewayConfig(tls_cert_file=cert_files[0])
    with pytest.raises(ConfigError, match="does not exist"):
        GatewayConfig(tls_cert_file=tmp_path / "no.pem", tls_key_file=cert_files[1])
    env = {
        "STATEBLOCK_TLS_CERT_FILE": str(cert_files[0]),
        "STATEBLOCK_TLS_KEY_FILE": str(cert_files[1]),
    }
    assert GatewayConfig.from_env(env).tls == cert_files
