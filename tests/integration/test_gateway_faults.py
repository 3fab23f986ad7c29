"""Faults that are not the request's, through real parts (a nats-server, the capture, readout
workers and the gateway on real ports): concurrent retries with one Idempotency-Key."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from capture_svc.config import CaptureConfig
from capture_svc.server import running_capture
from readout_svc.config import ReadoutServiceConfig
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.test_gateway_errors import gateway_config, gateway_for, readout_for


class Path:
    """Capture and gateway on `nc`; `readout()` starts a worker (a test may hold it back
    until its requests wait)."""

    def __init__(self, nc, engine, signer: Signer, gateway) -> None:
        self.nc, self.engine, self.gw = nc, engine, gateway
        self._trust = TrustStore([signer.public_key])

    def readout(self, **kw):
        config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2, **kw)
        return readout_for(config, self.nc, self.engine, self._trust)


@asynccontextmanager
async def capture_and_gateway(nc, decoder_dir, serving_model, engine, **gateway_kw):
    signer = Signer.generate()
    async with (
        running_capture(
            CaptureConfig(port=0, host="127.0.0.1"),
            nc=nc,
            model=serving_model,
            signer=signer,
            metrics=CollectorRegistry(),
        ) as capture,
        gateway_for(
            gateway_config(decoder_dir, f"127.0.0.1:{capture.port}", **gateway_kw),
            nc,
            serving_model,
        ) as gw,
    ):
        yield Path(nc, engine, signer, gw)


@pytest.fixture
async def path(nc, decoder_dir, serving_model, engine):
    async with capture_and_gateway(nc, decoder_dir, serving_model, engine) as p:
        yield p


async def test_concurrent_retries_with_one_key_each_get_the_one_answer(path):
    """Issue 39.1: five identical keyed requests at once (HTTP, then gRPC) all get the one
    answer under the one request id; none fails because another waits on the same block.
    The worker starts once they all wait on the block."""
    gw = path.gw
    body = {"model": MODEL, "prompt": "copy: burst", "max_tokens": 8, "temperature": 1.0}
    req = gateway_pb2.GenerateRequest(model=MODEL, prompt="copy: burst", max_tokens=8)
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)
        keyed = {"headers": {"Idempotency-Key": "burst"}, "timeout": 30}
        replies = asyncio.gather(
            *(http.post("/v1/completions", json=body, **keyed) for _ in range(5))
        )
        metadata = (("idempotency-key", "g-burst"),)
        answers = asyncio.gather(
            *(stub.Generate(req, metadata=metadata, timeout=30) for _ in range(5))
        )
        await asyncio.sleep(1.0)
        async with path.readout():
            replies, answers = await replies, await answers
    assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies]
    assert len({r.json()["id"] for r in replies}) == 1
    assert len({repr(r.json()["choices"]) for r in replies}) == 1
    assert len({a.request_id for a in answers}) == 1
    assert len({a.SerializeToString(deterministic=True) for a in answers}) == 1
