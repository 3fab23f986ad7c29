"""The gateway assembled: HTTP + gRPC over one GatewayService; `python -m gateway`."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import nats
import structlog
from prometheus_client import CollectorRegistry

from gateway.capture_client import CHANNEL_OPTIONS, GrpcCaptureClient
from gateway.commits import CommitWatcher
from gateway.config import GatewayConfig
from gateway.detokenizer import Detokenizer
from gateway.grpc_server import serve_grpc
from gateway.http import create_app, serve_http
from gateway.idempotency import KvKeyStore
from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from registry import Registry
from stateblock import runtime
from stateblock.nats_client import NatsState, Readiness, connected, probing, round_trip
from stateblock.protocol.keys import TrustStore
from stateblock.protocol.manifest import decoder_manifest, default_max_tokens

log = structlog.get_logger("gateway")


@dataclass(frozen=True)
class RunningGateway:
    http_port: int
    grpc_port: int
    service: GatewayService


def _readout_trust(config: GatewayConfig, given: TrustStore | None) -> TrustStore:
    """The keys whose commits the gateway believes: `given`, or the configured directory's."""
    trust = given if given is not None else TrustStore.from_dir(config.readout_trusted_keys_dir)
    if len(trust) == 0:
        raise runtime.ConfigError(
            f"no readout key in {config.readout_trusted_keys_dir} "
            "(STATEBLOCK_READOUT_TRUSTED_KEYS_DIR): no answer could ever be believed"
        )
    return trust


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig,
    *,
    nc: nats.NATS,
    metrics: CollectorRegistry,
    tokenizer=None,
    readout_trust: TrustStore | None = None,
    nats_state: NatsState | None = None,
) -> AsyncIterator[RunningGateway]:
    runtime.keep_freed_buffers()  # state blocks are multi-MB: no page faults per copy
    manifest = decoder_manifest(config.decoder_dir)
    tokenizer = tokenizer if tokenizer is not None else Detokenizer.load(config.base_dir)
    readout_trust = _readout_trust(config, readout_trust)
    registry = await Registry.open(nc.jetstream(), replicas=config.nats_replicas)
    keys = await KvKeyStore.open(
        nc.jetstream(), ttl_s=config.idempotency_ttl_s, replicas=config.nats_replicas
    )
    async with AsyncExitStack() as stack:
        commits = await stack.enter_async_context(
            CommitWatcher.open(registry, readout_trust, metrics=metrics)
        )
        # round_robin over every address the target resolves to: behind a headless Service
        # (the Helm chart's) each capture replica gets its share, not the first one only
        channel = grpc.aio.insecure_channel(config.capture_target, options=CHANNEL_OPTIONS)
        stack.push_async_callback(channel.close)
        capture = GrpcCaptureClient(channel, runtime.capture_token(config.capture_token_file))
        # ready while NATS answers a round trip and a capture answers its health check;
        # readout workers are not asked: the work queue holds blocks until they come
        readiness = await stack.enter_async_context(
            probing(
                Readiness(nats_state),
                {"nats": functools.partial(round_trip, nc), "capture": capture.answering},
                config.ready_timeout_s,
            )
        )
        service = GatewayService(
            capture,
            commits,
            tokenizer,
            GatewayMetrics(metrics, config.model_name),
            config=config,
            default_max_tokens=default_max_tokens(manifest, config.limits.answer_depth_max),
            fingerprint=f"fp_{manifest.get('decoder_digest', '')[:16]}",
            decoder_digest=manifest.get("decoder_digest", ""),
            idempotency=keys,
        )
        # Entered in this order, exited in reverse: HTTP stops first, then gRPC.
        grpc_port = await stack.enter_async_context(
            serve_grpc(
                service,
                config.host,
                config.grpc_port,
                config.grace_s,
                readiness,
                api_key=config.api_key,
                tls=config.tls,
            )
        )
        app = create_app(
            service,
            metrics=metrics,
            created=int(time.time()),
            readiness=readiness,
            max_body_bytes=config.max_body_bytes,
            api_key=config.api_key,
        )
        http_port = await stack.enter_async_context(
            serve_http(app, config.host, config.http_port, config.grace_s, config.tls)
        )
        log.info("gateway listening", http_port=http_port, grpc_port=grpc_port)
        yield RunningGateway(http_port, grpc_port, service)


async def main() -> None:
    config = GatewayConfig.from_env()
    shutdown, metrics = runtime.service_started(config.log_level)
    tokenizer = await asyncio.to_thread(Detokenizer.load, config.base_dir)
    async with AsyncExitStack() as stack:
        # drained after the servers have stopped
        nc, state = await connected(stack, config.nats_url, "gateway", metrics)
        await stack.enter_async_context(runtime.loop_lag(metrics))
        await stack.enter_async_context(
            running_gateway(config, nc=nc, metrics=metrics, tokenizer=tokenizer, nats_state=state)
        )
        await shutdown.wait()
        log.info("shutting down", grace_s=config.grace_s)
