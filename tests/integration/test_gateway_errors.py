"""The gateway when nothing can serve (503 / UNAVAILABLE) and when no answer comes in time
(504 / DEADLINE_EXCEEDED): a clear error, never an autoregressive fallback."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from capture_svc.config import CaptureConfig
from capture_svc.server import running_capture
from gateway.config import GatewayConfig
from gateway.server import running_gateway
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.app.nats_server import free_port
from stateblock.protocol import streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.sampling import Limits
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "copy: a"}], "max_tokens": 4}


def gateway_config(decoder_dir, capture_target: str, timeout_s: float = 30.0) -> GatewayConfig:
    return GatewayConfig(
        capture_target=capture_target,
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        decoder_dir=decoder_dir,
        request_timeout_s=timeout_s,
    )


def gateway_for(config: GatewayConfig, nc, serving_model):
    return running_gateway(
        config,
        nc=nc,
        metrics=CollectorRegistry(),
        tokenizer=serving_model.tokenizer,
        readout_trust=READOUT_TRUST,
    )


def readout_for(config: ReadoutServiceConfig, nc, engine, trust: TrustStore):
    """Workers that trust `trust`'s capture keys and sign with the tests' readout key."""
    return running_readout(
        config,
        nc=nc,
        engine=engine,
        trust=trust,
        signer=READOUT_SIGNER,
        metrics=CollectorRegistry(),
    )


async def expect(
    gw, http_status: int, error_type: str, grpc_code: grpc.StatusCode, detail: str = ""
) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
        r = await http.post("/v1/chat/completions", json=BODY, timeout=30)
    assert r.status_code == http_status, r.text
    error = r.json()["error"]
    assert error["type"] == error_type and detail in error["message"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(
                gateway_pb2.GenerateRequest(model=MODEL, prompt="copy: a"), timeout=30
            )
    assert info.value.code() == grpc_code and detail in info.value.details()


async def test_unreachable_capture_is_503_unavailable(nc, decoder_dir, serving_model):
    """Retried until the deadline (a capture may be restarting), then 503: not executed."""
    config = gateway_config(decoder_dir, f"127.0.0.1:{free_port()}", timeout_s=1.5)
    async with gateway_for(config, nc, serving_model) as gw:
        await expect(gw, 503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE)


async def test_no_readout_worker_is_504_deadline_exceeded(nc, decoder_dir, serving_model):
    capture_config = CaptureConfig(port=0, host="127.0.0.1")
    async with running_capture(
        capture_config,
        nc=nc,
        model=serving_model,
        signer=Signer.generate(),
        metrics=CollectorRegistry(),
    ) as capture:
        config = gateway_config(decoder_dir, f"127.0.0.1:{capture.port}", timeout_s=0.5)
        async with gateway_for(config, nc, serving_model) as gw:
            await expect(gw, 504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_rejected_block_fails_fast_not_at_the_deadline(
    nc, decoder_dir, serving_model, engine
):
    """A genuine block the workers will not read (deeper than their limit): its signed
    rejection fails the request at once with the reason, not after the deadline; the reason
    describes the request, which its client can change (400)."""
    capture_config = CaptureConfig(port=0, host="127.0.0.1")
    signer = Signer.generate()
    readout_config = ReadoutServiceConfig(
        nats_url="unused", workers=1, fetch_timeout_s=0.2, limits=Limits(answer_depth_max=2)
    )
    async with (
        running_capture(
            capture_config, nc=nc, model=serving_model, signer=signer, metrics=CollectorRegistry()
        ) as capture,
        readout_for(readout_config, nc, engine, TrustStore([signer.public_key])),
        gateway_for(
            gateway_config(decoder_dir, f"127.0.0.1:{capture.port}"), nc, serving_model
        ) as gw,
    ):
        t0 = time.monotonic()
        await expect(gw, 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT, "over 2")
        assert time.monotonic() - t0 < 10


async def test_a_block_that_does_not_verify_fails_no_request(
    nc, decoder_dir, serving_model, engine
):
    """Capture signs with a key the workers do not trust: to the workers that block is
    indistinguishable from a forgery naming this request, so it must not end the request
    (it times out; the block goes to the rejected stream, marked unverified)."""
    capture_config = CaptureConfig(port=0, host="127.0.0.1")
    readout_config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
    js = nc.jetstream()
    async with (
        running_capture(
            capture_config,
            nc=nc,
            model=serving_model,
            signer=Signer.generate(),
            metrics=CollectorRegistry(),
        ) as capture,
        readout_for(readout_config, nc, engine, TrustStore([Signer.generate().public_key])),
        gateway_for(
            gateway_config(decoder_dir, f"127.0.0.1:{capture.port}", timeout_s=3.0),
            nc,
            serving_model,
        ) as gw,
    ):
        sub = await js.subscribe(streams.rejected_subject(">"), ordered_consumer=True)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
            r = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "copy: a"}, timeout=30
            )
        assert r.status_code == 504, r.text
        msg = await sub.next_msg(timeout=5)
        assert msg.headers[streams.REASON_HEADER] == "unknown_key"
        assert msg.headers[streams.VERIFIED_HEADER] == "false"


async def test_a_request_sent_while_capture_restarts_is_answered(
    nc, decoder_dir, serving_model, engine
):
    """Issue 16.5: the capture is down when the request arrives and comes up a moment later;
    the gateway sends the request again (nothing ran) and the client gets its answer."""
    port = free_port()
    signer = Signer.generate()
    readout_config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
    async with (
        readout_for(readout_config, nc, engine, TrustStore([signer.public_key])),
        gateway_for(
            gateway_config(decoder_dir, f"127.0.0.1:{port}", timeout_s=30.0), nc, serving_model
        ) as gw,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http,
    ):
        body = {"model": MODEL, "prompt": "copy: ab", "max_tokens": 4}
        request = asyncio.create_task(http.post("/v1/completions", json=body, timeout=30))
        await asyncio.sleep(1.0)
        assert not request.done()
        capture_config = CaptureConfig(port=port, host="127.0.0.1")
        async with running_capture(
            capture_config, nc=nc, model=serving_model, signer=signer, metrics=CollectorRegistry()
        ):
            r = await asyncio.wait_for(request, 20)
        assert r.status_code == 200, r.text
