"""Faults that are not the request's, through real parts (a nats-server, the capture, readout
workers and the gateway on real ports): concurrent retries with one Idempotency-Key, a
stalled nats-server or an unreachable capture (readiness), a lost payload object, a block
that expired unread."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
from contextlib import asynccontextmanager

import grpc
import httpx
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from capture_svc.config import CaptureConfig
from capture_svc.server import CAPTURE_SERVICE, running_capture
from gateway.grpc_server import SERVICE as GATEWAY_SERVICE
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import serve_health
from readout_svc.worker import EngineHealth
from stateblock.app.nats_server import free_port
from stateblock.nats_client import LIVENESS, Readiness, probing, round_trip
from stateblock.protocol import streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.test_gateway_errors import gateway_config, gateway_for, readout_for


class Path:
    """Capture and gateway on `nc`; `readout()` starts a worker (a test may hold it back
    until its requests wait)."""

    def __init__(self, nc, engine, signer: Signer, gateway, capture_port: int) -> None:
        self.nc, self.engine, self.gw, self.capture_port = nc, engine, gateway, capture_port
        self._trust = TrustStore([signer.public_key])

    def readout(self, **kw):
        config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2, **kw)
        return readout_for(config, self.nc, self.engine, self._trust)


READY_TIMEOUT_S = 1.0
# unready within one probe's timeout and the pause before the next; a few probes of margin
# for a loaded CI machine
READY_BOUND_S = 4 * READY_TIMEOUT_S + 2
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@asynccontextmanager
async def capture_and_gateway(
    nc, decoder_dir, serving_model, engine, block_ttl_s: float = 120.0, **gateway_kw
):
    signer = Signer.generate()
    gateway_kw.setdefault("ready_timeout_s", READY_TIMEOUT_S)
    capture_config = CaptureConfig(
        port=0, host="127.0.0.1", ready_timeout_s=READY_TIMEOUT_S, block_ttl_s=block_ttl_s
    )
    async with (
        running_capture(
            capture_config,
            nc=nc,
            model=serving_model,
            signer=signer,
            metrics=CollectorRegistry(),
        ) as capture,
        gateway_for(
            dataclasses.replace(
                gateway_config(decoder_dir, f"127.0.0.1:{capture.port}"), **gateway_kw
            ),
            nc,
            serving_model,
        ) as gw,
    ):
        yield Path(nc, engine, signer, gw, capture.port)


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


async def health_of(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)).status


async def gateway_ready(gw) -> set[bool]:
    """Whether HTTP /health and gRPC health under both readiness names say ready."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
        r = await http.get("/health", timeout=5)
    assert r.status_code in (200, 503), r.text
    grpc_status = {await health_of(gw.grpc_port, name) for name in ("", GATEWAY_SERVICE)}
    assert grpc_status <= {SERVING, NOT_SERVING}
    return {r.status_code == 200} | {status == SERVING for status in grpc_status}


async def becomes(probe, want: bool, within_s: float = READY_BOUND_S) -> float:
    """Seconds until every answer of `await probe()` is `want`; fails after `within_s`."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await probe() != {want}:
        assert loop.time() - t0 < within_s, f"still {not want} after {within_s:g}s"
        await asyncio.sleep(0.1)
    return loop.time() - t0


@asynccontextmanager
async def readout_health(nc):
    """The readout process's health port as its main() composes it; yields the port."""
    probes = {"nats": functools.partial(round_trip, nc)}
    async with (
        probing(Readiness(), probes, READY_TIMEOUT_S) as readiness,
        serve_health("127.0.0.1", 0, readiness, EngineHealth()) as port,
    ):
        yield port


async def test_readiness_fails_while_nats_stalls_and_recovers_after(path, nats_server):
    """Issue 39.5: a SIGSTOPped nats-server keeps its TCP connections up and answers nothing;
    the gateway's, the capture's and the readout's readiness see the unanswered round trip
    within the bound, liveness stays SERVING, and all recover once it answers again. No
    readout worker runs until the end: the gateway's readiness does not wait for one."""
    gw = path.gw

    async def serving(port: int, *names: str) -> set[bool]:
        return {await health_of(port, name) == SERVING for name in names}

    async with readout_health(path.nc) as readout_port:
        probes = [
            lambda: gateway_ready(gw),
            lambda: serving(path.capture_port, "", CAPTURE_SERVICE),
            lambda: serving(readout_port, ""),
        ]
        for probe in probes:
            assert await probe() == {True}
        os.kill(nats_server.proc.pid, signal.SIGSTOP)
        try:
            for probe in probes:
                await becomes(probe, False)
            for port in (gw.grpc_port, path.capture_port, readout_port):
                assert await health_of(port, LIVENESS) == SERVING
        finally:
            os.kill(nats_server.proc.pid, signal.SIGCONT)
        for probe in probes:
            await becomes(probe, True)
    async with (  # the connection still carries requests after the stall
        path.readout(),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http,
    ):
        body = {"model": MODEL, "prompt": "copy: ab", "max_tokens": 4}
        r = await http.post("/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


async def test_readiness_fails_while_the_capture_is_unreachable(nc, decoder_dir, serving_model):
    """The gateway is ready only while its capture answers a health check: unready with
    none listening, ready once one starts on that address."""
    port = free_port()
    config = gateway_config(decoder_dir, f"127.0.0.1:{port}")
    config = dataclasses.replace(config, ready_timeout_s=READY_TIMEOUT_S)
    async with gateway_for(config, nc, serving_model) as gw:
        await becomes(lambda: gateway_ready(gw), False)
        capture_config = CaptureConfig(port=port, host="127.0.0.1")
        async with running_capture(
            capture_config,
            nc=nc,
            model=serving_model,
            signer=Signer.generate(),
            metrics=CollectorRegistry(),
        ):
            await becomes(lambda: gateway_ready(gw), True)


@pytest.fixture
async def small_nc(start_nats_server):
    """A nats-server whose max_payload sends any block of a few dozen rows through the
    object store."""
    conn = await nats.connect(start_nats_server(max_payload=16 * 1024).url)
    yield conn
    await conn.close()


def metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def test_a_lost_payload_object_is_captured_again_and_answered(
    small_nc, decoder_dir, serving_model, engine
):
    """Issue 39.3: the block's rows object is deleted before any worker reads it; the
    worker's signed object_missing rejection is not the request's fault, so the gateway
    captures it again as a new block and both requests with the key (the first and a retry
    that follows it) get the answer the same request gets without the fault, under one id."""
    body = {"model": MODEL, "prompt": "copy: " + "abcdefgh" * 5, "max_tokens": 8}
    keyed = {"headers": {"Idempotency-Key": "lost-object"}, "timeout": 60}
    objects = await streams.payload_store(small_nc.jetstream())
    async with capture_and_gateway(small_nc, decoder_dir, serving_model, engine) as path:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{path.gw.http_port}") as http:
            first = asyncio.create_task(http.post("/v1/completions", json=body, **keyed))
            lost = await until_an_object(objects)
            follower = asyncio.create_task(http.post("/v1/completions", json=body, **keyed))
            await objects.delete(lost)
            async with path.readout():
                replies = [await first, await follower]
                clean = await http.post("/v1/completions", json=body, timeout=60)
            text = (await http.get("/metrics")).text
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert replies[0].json()["id"] == replies[1].json()["id"]
    assert clean.status_code == 200, clean.text
    assert replies[0].json()["choices"] == replies[1].json()["choices"] == clean.json()["choices"]
    assert metric(text, "stateblock_gateway_recaptures_total", reason="object_missing") == 1


async def test_a_block_that_expired_unread_is_captured_again_and_answered(
    nc, decoder_dir, serving_model, engine
):
    """No worker runs until the request's first block has expired: its signed `expired`
    rejection is not the request's fault, so the gateway captures it again and answers."""
    body = {"model": MODEL, "prompt": "copy: late", "max_tokens": 4}
    async with capture_and_gateway(nc, decoder_dir, serving_model, engine, block_ttl_s=2.0) as path:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{path.gw.http_port}") as http:
            request = asyncio.create_task(http.post("/v1/completions", json=body, timeout=60))
            await asyncio.sleep(3.0)
            async with path.readout():
                r = await request
                clean = await http.post("/v1/completions", json=body, timeout=60)
            text = (await http.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == clean.json()["choices"]
    assert metric(text, "stateblock_gateway_recaptures_total", reason="expired") == 1


async def until_an_object(objects) -> str:
    """The name of the first payload object the store holds."""
    for _ in range(300):
        try:
            infos = await objects.list()
        except nats.js.errors.NotFoundError:  # none yet
            infos = []
        if infos:
            return infos[0].name
        await asyncio.sleep(0.05)
    raise AssertionError("no payload object was stored")
