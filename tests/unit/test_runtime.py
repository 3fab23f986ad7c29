"""The services' event loop: `runtime.run` and STATEBLOCK_EVENT_LOOP."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings

import pytest
import structlog

from stateblock import runtime


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not built for Windows")
def test_uvloop_is_the_default_where_it_is_installed():
    assert runtime.uvloop is not None  # a dependency of the package on this platform
    assert runtime.event_loop_choice({}) == "uvloop"
    assert runtime.event_loop_choice({"STATEBLOCK_EVENT_LOOP": "auto"}) == "uvloop"
    assert runtime.run(loop_module(), {}) == "uvloop"


def test_asyncio_loop_on_request():
    env = {"STATEBLOCK_EVENT_LOOP": " AsyncIO "}
    assert runtime.event_loop_choice(env) == "asyncio"
    assert runtime.run(loop_module(), env) == "asyncio"


def test_an_unknown_loop_is_a_config_error_and_nothing_runs():
    coro = loop_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(runtime.ConfigError, match="STATEBLOCK_EVENT_LOOP='trio'"):
            runtime.run(coro, {"STATEBLOCK_EVENT_LOOP": "trio"})
        del coro
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_uvloop_asked_for_but_missing_is_a_config_error(monkeypatch):
    monkeypatch.setattr(runtime, "uvloop", None)
    assert runtime.event_loop_choice({}) == "asyncio"  # auto falls back
    with pytest.raises(runtime.ConfigError, match="not installed"):
        runtime.event_loop_choice({"STATEBLOCK_EVENT_LOOP": "uvloop"})


def test_logged_exceptions_never_carry_their_frames_locals(capsys):
    """A failed readout's traceback must not dump the block header, signature or rows its
    frames hold (structlog's dict tracebacks show locals by default)."""
    runtime.configure_logging("info")
    log = structlog.get_logger("t")

    def readout(header_signature: bytes) -> None:
        raise ValueError("readout failed")

    try:
        readout(b"SECRET-SIGNATURE-BYTES")
    except ValueError:
        log.exception("readout failed")
    line = capsys.readouterr().err
    assert "readout failed" in line and "ValueError" in line
    assert "SECRET-SIGNATURE-BYTES" not in line and "header_signature" not in line


def test_redelivery_must_fit_inside_the_request_deadline():
    runtime.check_redelivery(15.0, 60.0)
    with pytest.raises(runtime.ConfigError, match="STATEBLOCK_ACK_WAIT_S=90 must be at most half"):
        runtime.check_redelivery(90.0, 60.0)


def test_any_hugging_face_style_model_name_has_its_own_nats_token():
    from stateblock.protocol import streams

    assert streams.model_token("stateblock-reference") == "stateblock-reference"
    names = ["org/model-v2", "org/model-v2.1", "org_model-v2_1", "Org/Model.v2 "[:-1]]
    tokens = [streams.model_token(n) for n in names]
    assert len(set(tokens)) == len(names)
    for token in tokens:
        assert all(c.isalnum() or c in "_-" for c in token), token
    assert streams.blocks_subject("org/model-v2.1").count(".") == 2  # stateblock.blocks.<token>
    assert runtime.model_name("org/model-v2.1") == "org/model-v2.1"
    for bad in ("", "a b", "x" * 257, "a\nb"):
        with pytest.raises(runtime.ConfigError, match="STATEBLOCK_MODEL_NAME"):
            runtime.model_name(bad)


async def test_a_max_connection_age_makes_clients_reconnect_without_failing_a_call():
    """The capture's `max_connection_age_s`: gRPC resolves a target again only when a
    connection ends, so an aged connection is how gateways reach replicas added since.
    Every call goes through while the server closes connections under it."""
    import grpc

    peers: list[str] = []

    async def peer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        peers.append(context.peer())  # the client's address: a new port, a new connection
        return request

    server = runtime.grpc_server(max_connection_age_s=0.2)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Echo", {"Peer": grpc.unary_unary_rpc_method_handler(peer)})])  # fmt: skip
    port = runtime.grpc_bind(server, "127.0.0.1", 0, "test")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Echo/Peer")
            for i in range(20):
                assert await call(bytes([i]), timeout=5) == bytes([i])
                await asyncio.sleep(0.05)
    finally:
        await server.stop(None)
    assert len(peers) == 20 and len(set(peers)) >= 2, set(peers)


async def test_probing_stops_even_when_wait_for_loses_its_cancel():
    """Python 3.11's wait_for returns the probe's result, dropping the cancel, when the probe
    finishes in the same loop turn as the cancel arrives (the gateway's capture probe did, and
    a test's teardown waited forever on it). `probing` still stops at the context's exit."""
    from stateblock.nats_client import Readiness, probing

    started = asyncio.Event()
    gate = asyncio.get_running_loop().create_future()

    async def probe(_timeout_s: float) -> None:
        started.set()
        await gate

    async def leave() -> None:
        async with probing(Readiness(), {"dep": probe}, 30.0):
            await started.wait()
            gate.set_result(None)  # the probe answers in the turn its cancel arrives

    await asyncio.wait_for(leave(), 10)


async def test_a_held_event_loop_shows_as_one_late_wakeup():
    """`loop_lag`: a synchronous 60 ms on the loop is one wake-up at least 50 ms late (the
    watcher sleeps 10 ms at a time); the watcher stops with the block."""
    import time

    from prometheus_client import CollectorRegistry

    metrics = CollectorRegistry()
    name = "stateblock_event_loop_lag_seconds"
    async with runtime.loop_lag(metrics):
        await asyncio.sleep(0.05)
        time.sleep(0.06)  # the loop held
        await asyncio.sleep(0.03)
    total = metrics.get_sample_value(f"{name}_count")
    within_25ms = metrics.get_sample_value(f"{name}_bucket", {"le": "0.025"})
    assert total >= 3 and total - within_25ms >= 1
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "loop-lag"]
    await asyncio.sleep(0.03)
    assert metrics.get_sample_value(f"{name}_count") == total
