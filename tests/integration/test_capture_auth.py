"""The capture's door: a real capture gRPC server with a token file refuses Capture calls
that do not present the token (UNAUTHENTICATED, with the reason) and serves those that do;
health stays open; the gateway sends the token it is configured with; a capture without a
token will not listen beyond loopback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from capture_svc.config import CaptureConfig
from capture_svc.server import running_capture
from gateway.config import GatewayConfig
from gateway.server import running_gateway
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.protocol import tokens
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REPO, ConfigError
from stateblock.v1 import capture_pb2, capture_pb2_grpc
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST

LANE = capture_pb2.CaptureLane(prompt="copy: ab", max_tokens=4)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "capture-token"
    tokens.load_or_generate_token(path)
    return path


def capture_with(token_file, nc, serving_model, signer=None, metrics=None):
    config = CaptureConfig(port=0, token_file=token_file)
    return running_capture(
        config,
        nc=nc,
        model=serving_model,
        signer=signer or Signer.generate(),
        metrics=metrics or CollectorRegistry(),
    )


def captures(metrics: CollectorRegistry) -> float:
    return metrics.get_sample_value("stateblock_capture_seconds_count") or 0.0


async def test_capture_calls_need_the_token_health_does_not(nc, serving_model, token_file):
    token = tokens.read_token(token_file)
    metrics = CollectorRegistry()
    async with (
        capture_with(token_file, nc, serving_model, metrics=metrics) as capture,
        grpc.aio.insecure_channel(f"127.0.0.1:{capture.port}") as channel,
    ):
        stub = capture_pb2_grpc.CaptureStub(channel)
        wrong = tokens.bearer("x" * len(token))
        for metadata in (None, wrong, (("authorization", token),)):  # the last: no scheme
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Capture(
                    capture_pb2.CaptureRequest(request_id="r", model=MODEL, lanes=[LANE]),
                    metadata=metadata,
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "capture token" in refused.value.details()
        assert captures(metrics) == 0  # a refused call ran nothing
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # Cancel sits behind it too
            await stub.Cancel(capture_pb2.CancelRequest(request_id="r"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await stub.Cancel(
            capture_pb2.CancelRequest(request_id="none"), metadata=tokens.bearer(token), timeout=10
        )
        assert reply.dropped is False  # nothing queued under that id

        reply = await stub.Capture(
            capture_pb2.CaptureRequest(request_id="r-ok", model=MODEL, lanes=[LANE]),
            metadata=tokens.bearer(token),
            timeout=30,
        )
        assert reply.request_id == "r-ok" and reply.block_id and reply.prompt_tokens
        assert captures(metrics) == 1

        health = health_pb2_grpc.HealthStub(channel)  # probes carry no token
        status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a wrong one is refused
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=wrong)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def gateway_with(decoder_dir, serving_model, nc, target, token_file):
    config = GatewayConfig(
        capture_target=target,
        capture_token_file=token_file,
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        decoder_dir=decoder_dir,
        request_timeout_s=30.0,
    )
    return running_gateway(
        config,
        nc=nc,
        metrics=CollectorRegistry(),
        tokenizer=serving_model.tokenizer,
        readout_trust=READOUT_TRUST,
    )


async def test_gateway_with_the_token_file_answers_end_to_end(
    nc, decoder_dir, serving_model, engine, token_file, tmp_path
):
    signer = Signer.generate()
    readout_config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
    other = tmp_path / "other-token"
    tokens.load_or_generate_token(other)
    async with (
        capture_with(token_file, nc, serving_model, signer) as capture,
        running_readout(
            readout_config,
            nc=nc,
            engine=engine,
            trust=TrustStore([signer.public_key]),
            signer=READOUT_SIGNER,
            metrics=CollectorRegistry(),
        ),
    ):
        target = f"127.0.0.1:{capture.port}"
        async with gateway_with(decoder_dir, serving_model, nc, target, token_file) as gw:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="-", max_retries=0
            )
            r = await client.completions.create(model=MODEL, prompt="copy: ab", max_tokens=4)
            assert r.choices[0].text and r.usage.completion_tokens > 0
        # a gateway holding another token: a clear 503 that names the cause, nothing run
        async with gateway_with(decoder_dir, serving_model, nc, target, other) as gw:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="-", max_retries=0
            )
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=MODEL, prompt="copy: ab", max_tokens=4)
            assert refused.value.status_code == 503
            assert "token" in refused.value.message
            # and its readiness says so, while a gateway holding the token is ready
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
                health = await health_when(http, lambda r: r.status_code == 503)
            assert health.status_code == 503 and "token" in health.json()["why"], health.text
        async with gateway_with(decoder_dir, serving_model, nc, target, token_file) as gw:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
                await asyncio.sleep(1.0)  # a probe round or more
                assert (await http.get("/health")).status_code == 200


def test_no_token_binds_loopback_and_refuses_an_open_host(tmp_path):
    assert CaptureConfig().bind_host == "127.0.0.1"
    assert CaptureConfig(token_file=tmp_path / "t").bind_host == "0.0.0.0"
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert CaptureConfig(host=host).bind_host == host
    for host in ("0.0.0.0", "::", "10.1.2.3", "capture.example"):
        with pytest.raises(ConfigError, match="STATEBLOCK_CAPTURE_TOKEN_FILE"):
            CaptureConfig(host=host)
    assert CaptureConfig(host="0.0.0.0", token_file=tmp_path / "t").bind_host == "0.0.0.0"


def test_capture_process_on_an_open_host_without_a_token_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEBLOCK_")}
    env["STATEBLOCK_CAPTURE_HOST"] = "0.0.0.0"
    done = subprocess.run(
        [sys.executable, "-m", "capture_svc"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "STATEBLOCK_CAPTURE_TOKEN_FILE" in lines[0], done.stderr


def test_token_files(tmp_path):
    path = tmp_path / "t"
    token = tokens.load_or_generate_token(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert tokens.load_or_generate_token(path) == token  # kept, not regenerated
    assert tokens.presented_ok(f"Bearer {token}", token)
    assert not tokens.presented_ok(f"Bearer {token}x", token)
    assert not tokens.presented_ok("Bearer é", token)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least"):
        tokens.read_token(short)
    with pytest.raises(ValueError, match="cannot be read"):
        tokens.read_token(tmp_path / "missing")


def test_stateblock_up_generates_the_token_and_answers_with_it(stack):
    """The embedded stack writes its token on first run (0600) and its gateway presents it."""
    path = stack.config.data_dir / "capture-token"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and tokens.read_token(path)
    client = openai.OpenAI(base_url=f"{stack.urls.http}/v1", api_key="-", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="copy: ab", max_tokens=4)
    assert r.choices[0].text and r.usage.completion_tokens > 0


async def health_when(http, settled, seconds: float = 10.0):
    """/health once `settled(reply)` holds or `seconds` passed (probes run in rounds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        reply = await http.get("/health")
        if settled(reply) or loop.time() > deadline:
            return reply
        await asyncio.sleep(0.2)
