"""The readout service's own health check (grpc.health.v1 on its event loop): SERVING while
NATS is connected and the engine answers."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readout_svc.server import LIVENESS, serve_health
from readout_svc.worker import EngineHealth
from stateblock.nats_client import NatsState, Readiness

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_follows_nats_and_the_engine():
    state, engine = NatsState("t", connected=True), EngineHealth()
    async with serve_health("127.0.0.1", 0, Readiness(state), engine) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status():
                await asyncio.sleep(0.05)  # listeners run as tasks on this loop
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                return reply.status

            assert await status() == SERVING
            for _ in range(EngineHealth.LIMIT - 1):
                engine.record(False)
            assert await status() == SERVING  # a failure or two: a bad block, not the engine
            engine.record(False)
            assert await status() == NOT_SERVING
            engine.record(True)
            assert await status() == SERVING
            await state.set(False)
            assert await status() == NOT_SERVING
            alive = await stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
            assert alive.status == SERVING  # out of service, not to be restarted
            await state.set(True)
            assert await status() == SERVING
