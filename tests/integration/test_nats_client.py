"""The services' NATS connection against real nats-servers: bounded at start-up, forever
once connected (nats-py's default gives up after 60 attempts, about two minutes), and a
state that health checks and metrics follow."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import nats
import pytest
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from stateblock.app.nats_server import (
    free_port,
    nats_server_binary,
    start_nats_server,
    stop_nats_server,
)
from stateblock.nats_client import (
    NatsOptions,
    NatsState,
    NatsUnreachable,
    Readiness,
    connect,
    follow_in_health,
    parse_servers,
)
from tests.helpers import self_signed


def test_servers_are_a_comma_separated_list():
    assert parse_servers("nats://a:1, nats://b:2,") == ("nats://a:1", "nats://b:2")
    with pytest.raises(ValueError):
        parse_servers("a:1")
    with pytest.raises(ValueError):
        parse_servers(" , ")


async def test_an_unreachable_server_fails_start_up_with_one_clear_error():
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(NatsUnreachable, match="STATEBLOCK_NATS_URL"):
        await connect(NatsOptions.of(url, start_attempts=2, reconnect_wait_s=0.05), "t")
    assert time.monotonic() - t0 < 10


async def test_reconnects_after_more_attempts_than_start_up_allows(tmp_path):
    """Down for many times the start-up attempts: the connection comes back, health and the
    metrics follow it, and a message published after the outage arrives."""
    server = start_nats_server(tmp_path / "n")
    metrics = CollectorRegistry()
    state = NatsState.with_metrics("t", metrics)
    servicer = health.aio.HealthServicer()
    await follow_in_health(servicer, ("",), Readiness(state))
    options = NatsOptions.of(server.url, start_attempts=1, reconnect_wait_s=0.05)
    nc = await connect(options, "t", state)
    try:
        assert nc.options["max_reconnect_attempts"] == -1
        stop_nats_server(server)
        for _ in range(200):
            if not state.connected:
                break
            await asyncio.sleep(0.02)
        assert not state.connected
        status = await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.sleep(1.5)  # about 30 attempts at 0.05 s: far past start_attempts
        server = start_nats_server(tmp_path / "n", port=server.port)
        for _ in range(300):
            if state.connected:
                break
            await asyncio.sleep(0.05)
        assert state.connected and nc.is_connected
        status = await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert metrics.get_sample_value("stateblock_nats_connected") == 1
        assert metrics.get_sample_value("stateblock_nats_disconnects_total") == 1
        sub = await nc.subscribe("after.outage")
        await nc.publish("after.outage", b"x")
        assert (await sub.next_msg(timeout=5)).data == b"x"
    finally:
        await nc.close()
        stop_nats_server(server)


async def test_a_request_in_flight_when_the_server_dies_fails_at_once(tmp_path):
    """Its reply went to the old connection and can never come: it fails as soon as the
    connection drops, as a timeout would (its outcome unknown), not after its whole timeout
    (5 s for a JetStream call, all of which a readout worker whose claim is in flight at a
    nats-server kill would sit idle)."""
    server = start_nats_server(tmp_path / "n")
    nc = await connect(NatsOptions.of(server.url, reconnect_wait_s=0.05), "t")
    try:
        await nc.subscribe("never.answered")  # a responder that never replies
        await nc.flush()
        pending = asyncio.ensure_future(nc.request("never.answered", b"", timeout=30))
        await asyncio.sleep(0.2)
        assert not pending.done()
        t0 = time.monotonic()
        server.proc.kill()
        with pytest.raises(nats.errors.TimeoutError):
            await asyncio.wait_for(pending, 10)
        assert time.monotonic() - t0 < 5
        server = start_nats_server(tmp_path / "n", port=server.port)
        for _ in range(300):
            if nc.is_connected:
                break
            await asyncio.sleep(0.05)

        # a request sent after the reconnect is answered as usual
        async def respond(msg) -> None:
            await msg.respond(b"ok")

        sub = await nc.subscribe("answered", cb=respond)
        assert (await nc.request("answered", b"", timeout=5)).data == b"ok"
        await sub.unsubscribe()
    finally:
        await nc.close()
        stop_nats_server(server)


async def test_a_tls_server_needs_the_ca_every_service_is_given(tmp_path):
    """STATEBLOCK_NATS_TLS_CA: the services verify a TLS nats-server against it."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    conf = tmp_path / "tls.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\ntls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
    )
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        url = f"tls://127.0.0.1:{port}"
        env = {"STATEBLOCK_NATS_TLS_CA": str(cert)}
        nc = await connect(NatsOptions.of(url, env, start_attempts=1), "t")
        assert nc.is_connected
        await nc.close()
        with pytest.raises(NatsUnreachable):  # without the CA the certificate is not trusted
            await connect(NatsOptions.of(url, {}, start_attempts=1, reconnect_wait_s=0.05), "t")
    finally:
        proc.kill()
        proc.wait()


async def test_a_bare_api_error_is_retried_and_an_answer_about_the_request_is_not():
    """A publish answered `APIError()` mid-election succeeds when called again; a lost
    compare-and-swap or a missing key (APIError subclasses) is the answer, at once."""
    import nats.js.errors as jse

    from stateblock.nats_client import describe, retry_transient, transient

    assert transient(jse.APIError()) and transient(jse.APIError(code=503))
    assert transient(jse.ServerError(code=500))
    # a publish repeated while the first copy is still being applied (its ack lost)
    in_process = jse.APIError(
        code=409, err_code=10158, description="duplicate message id is in process"
    )
    assert transient(in_process) and "10158" in describe(in_process)
    assert not transient(jse.APIError(code=409, err_code=10071))
    for answer in (jse.APIError(code=400), jse.KeyWrongLastSequenceError(), jse.KeyNotFoundError(),
                   jse.BadRequestError(code=400), jse.NotFoundError(code=404)):  # fmt: skip
        assert not transient(answer), answer
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise jse.APIError()
        return "ack"

    assert await retry_transient(flaky, within_s=5, what="test", pause_s=0.01) == "ack"
    calls.clear()

    async def lost():
        calls.append(1)
        raise jse.KeyWrongLastSequenceError()

    with pytest.raises(jse.KeyWrongLastSequenceError):
        await retry_transient(lost, within_s=5, what="test", pause_s=0.01)
    assert len(calls) == 1
