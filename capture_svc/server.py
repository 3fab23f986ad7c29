"""Capture transport: the gRPC servicer, the assembled service, and `python -m capture_svc`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import nats
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from capture_svc.auth import CaptureTokenInterceptor
from capture_svc.batcher import MIN_BUCKET, ForwardBatcher, warm_shapes
from capture_svc.config import CaptureConfig
from capture_svc.dataplane import Sealer, data_plane
from capture_svc.forward import CohortForward
from capture_svc.plans import PlanTable, PlanTableMetrics
from capture_svc.publisher import BlockPublisher
from capture_svc.releases import serve_releases
from capture_svc.service import (
    CAPTURE_MODE,
    CaptureDropped,
    CaptureError,
    CaptureFailed,
    CaptureMetrics,
    CaptureService,
    CaptureUnavailable,
    CaptureWarmingUp,
    InvalidCapture,
)
from stateblock import runtime
from stateblock.model.arena import DeviceArena
from stateblock.model.capture import (
    WARM_RUNS,
    compile_as_served,
    compile_cache_counts,
    use_compile_cache,
)
from stateblock.model.chunked import new_cache
from stateblock.model.loading import ServingModel, load_service_model, parse_dtype
from stateblock.model.shm import HostRegions
from stateblock.model.slots import SlotPool
from stateblock.nats_client import (
    LIVENESS,
    NatsState,
    Readiness,
    connected,
    follow_in_health,
    probing,
    round_trip,
)
from stateblock.protocol import envelope, locator, streams
from stateblock.protocol.keys import Signer, load_or_generate_signer
from stateblock.v1 import capture_pb2, capture_pb2_grpc

log = structlog.get_logger("capture_svc")
CAPTURE_SERVICE = capture_pb2.DESCRIPTOR.services_by_name["Capture"].full_name
PARAM_METADATA = "stateblock-param"  # trailing metadata: which request field was invalid
ORIGIN_METADATA = "stateblock-origin"  # trailing metadata: the capture service answered
_STATUS = (
    (InvalidCapture, grpc.StatusCode.INVALID_ARGUMENT),
    (CaptureDropped, grpc.StatusCode.CANCELLED),
    (CaptureUnavailable, grpc.StatusCode.UNAVAILABLE),
    (CaptureFailed, grpc.StatusCode.INTERNAL),
)


def status_of(error: CaptureError) -> grpc.StatusCode:
    """The one translation of the capture error tree to gRPC."""
    return next(
        (code for kind, code in _STATUS if isinstance(error, kind)), grpc.StatusCode.UNKNOWN
    )


class CaptureServicer(capture_pb2_grpc.CaptureServicer):
    def __init__(self, service: CaptureService) -> None:
        self._service = service

    async def Capture(
        self, request: capture_pb2.CaptureRequest, context: grpc.aio.ServicerContext
    ) -> capture_pb2.CaptureResponse:
        with structlog.contextvars.bound_contextvars(request_id=request.request_id):
            try:
                captured = await self._service.capture(
                    request.request_id or None, request.model, request.lanes
                )
            except CaptureError as e:
                # ORIGIN_METADATA says the capture took the request in: an UNAVAILABLE
                # without it ran nothing (no capture reached, or one still warming up), so
                # the gateway sends it again
                took_in = not isinstance(e, CaptureWarmingUp)
                trailing = [(ORIGIN_METADATA, "capture")] if took_in else []
                param = getattr(e, "param", None)
                if param:
                    trailing.append((PARAM_METADATA, param))
                context.set_trailing_metadata(tuple(trailing))
                await context.abort(status_of(e), str(e))
        return capture_pb2.CaptureResponse(
            request_id=captured.request_id,
            block_id=captured.block_id,
            prompt_tokens=list(captured.prompt_tokens),
        )

    async def Cancel(
        self, request: capture_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> capture_pb2.CancelResponse:
        return capture_pb2.CancelResponse(dropped=self._service.cancel(request.request_id))


@dataclass(frozen=True)
class RunningCapture:
    port: int
    service: CaptureService
    plans: PlanTable
    slots: SlotPool | None  # the local data plane's: the readout of this process reads them


async def _health_not_serving(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """The health service on `server`: alive, not serving (follow_in_health takes over)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", CAPTURE_SERVICE):
        await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return servicer


async def _warm_up(
    forward: CohortForward, executor: Executor, config: CaptureConfig, metrics: CaptureMetrics
) -> None:
    """Compiled: every (lane bucket, width bucket) shape a cohort can run, once (a symbolic
    graph compiles on its first call; a shape that breaks one of its guards compiles again
    on its own), or WARM_RUNS times where the forward records and replays CUDA graphs.
    Eager: one throwaway forward, its first-call cost."""
    buckets = config.warm_lane_buckets
    shapes = [(1, MIN_BUCKET)]
    if buckets is not None:
        shapes = warm_shapes(buckets, config.warm_width_max, config.cohort)
    log.info("warming up", shapes=len(shapes), compile=config.compile)
    loop = asyncio.get_running_loop()
    runs = WARM_RUNS if config.replays_graphs else 1
    seconds = await loop.run_in_executor(executor, forward.warm_up, shapes, runs)
    metrics.warmup_seconds.set(seconds)
    if buckets is not None:
        counts = compile_cache_counts()
        for key, n in counts.items():
            cache, outcome = key.split("_")
            metrics.warmup_cache.labels(cache, outcome).set(n)
        log.info("warmed up", cache=str(config.compile_cache or "torch's own"), **counts)


def _slots(
    config: CaptureConfig, model: ServingModel
) -> SlotPool | HostRegions | DeviceArena | None:
    """Where the rows wait for their readout: the process's slot pool (`local`), this
    host's shared-memory regions (`host`), an arena on the capture's device (`ipc`), or
    none (the bus carries them)."""
    if config.data_plane == locator.LOCAL:
        return SlotPool(config.data_plane_slots)
    if config.data_plane == locator.CUDA_IPC:
        return DeviceArena(
            config.data_plane_arena_mb << 20, device=model.lm_head.device,
            slots=config.data_plane_slots,
        )  # fmt: skip
    if config.data_plane == locator.HOST:
        try:
            return HostRegions(config.data_plane_slots, config.block_ttl_s)
        except OSError as e:
            raise runtime.ConfigError(f"STATEBLOCK_DATA_PLANE=host: {e}") from e
    return None


def _door(config: CaptureConfig) -> list[grpc.aio.ServerInterceptor]:
    """The token check when the config names a token file; none on a loopback-only capture
    (CaptureConfig refuses a non-loopback host without one)."""
    token = runtime.capture_token(config.token_file)
    return [] if token is None else [CaptureTokenInterceptor(token)]


def _forward(
    model: ServingModel, plans: PlanTable, config: CaptureConfig, metrics: CaptureMetrics
) -> CohortForward:
    """The packed base forward, compiled when the config asks. Its CUDA graph trees
    (reduce-overhead) live until the process exits: releasing them at stop on the forward
    thread hung an in-process stack's stop on the H200 (the loop idle, waiting on that
    call), and a stack that never releases them stops cleanly."""
    if config.part_chunk_tokens is not None:
        try:
            new_cache(model.model, config.part_chunk_tokens)
        except ValueError as e:
            raise runtime.ConfigError(f"STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS: {e}") from None
    if config.compile != "off":
        if config.compile_cache is not None:
            use_compile_cache(config.compile_cache)
        compile_as_served(
            model.model,
            config.compile,
            size_oblivious=config.size_oblivious,
            rope_table=config.rope == "table",
        )
    return CohortForward(
        model.model,
        plans,
        pad_id=model.tokenizer.pad_token_id or 0,
        capture_mode=CAPTURE_MODE,
        lane_buckets=config.cohort_lane_buckets,
        min_lanes=config.cohort_min_lanes,
        thread_streams=not config.replays_graphs,  # a stream for each forward thread
        part_sms=config.part_sms,
        part_chunk=config.part_chunk_tokens,
        part_chunk_len=config.limits.prompt_len_max,
        on_compile=None if config.compile == "off" else metrics.compiled_after_warmup.inc,
    )


async def _serve(
    stack: AsyncExitStack, service: CaptureService, config: CaptureConfig
) -> tuple[int, health.aio.HealthServicer]:
    """The Capture gRPC server, started, its stop on `stack`; returns its port and its health
    servicer: the standard health service (Kubernetes' native gRPC probes and load balancers
    ask it), NOT_SERVING until the warm-up is done, and first on shutdown, so routing stops
    before in-flight work drains."""
    server = runtime.grpc_server(_door(config), max_connection_age_s=config.max_connection_age_s)
    capture_pb2_grpc.add_CaptureServicer_to_server(CaptureServicer(service), server)
    health_servicer = await _health_not_serving(server)
    port = runtime.grpc_bind(server, config.bind_host, config.port, "capture gRPC")
    await server.start()
    stack.push_async_callback(server.stop, config.grace_s)
    stack.push_async_callback(health_servicer.enter_graceful_shutdown)
    return port, health_servicer


async def _batcher(
    stack: AsyncExitStack, forward: CohortForward, config: CaptureConfig, metrics: CaptureMetrics
) -> tuple[ThreadPoolExecutor, ForwardBatcher]:
    """The forward threads and the batcher that runs cohorts on them, closed with `stack`.

    A thread for each cohort forward at once and one more, so a part of a request over the
    token bound runs beside the cohorts of those that fit. A forward replaying CUDA graphs:
    one, the thread whose warm-up recorded them (they are per thread); the batcher's runners
    take turns."""
    in_flight = config.forwards_in_flight
    threads = 1 if config.replays_graphs else in_flight + 1
    executor = stack.enter_context(ThreadPoolExecutor(threads, thread_name_prefix="capture-fwd"))
    batcher = await stack.enter_async_context(
        ForwardBatcher(
            forward,
            executor,
            window_s=config.batch_window_s,
            max_lanes=config.limits.max_lanes,
            cohort=config.cohort,
            on_cohort=metrics.cohort_lanes.observe,
            in_flight=in_flight,
            forward_part=forward.part,
            part_yield_s=config.part_yield_s,
        )
    )
    return executor, batcher


@asynccontextmanager
async def running_capture(
    config: CaptureConfig,
    *,
    nc: nats.NATS,
    model: ServingModel,
    signer: Signer,
    metrics: CollectorRegistry,
    nats_state: NatsState | None = None,
) -> AsyncIterator[RunningCapture]:
    """The Capture gRPC service, yielded once its forward is warmed up, serving until the
    context exits (grace, then stop). It listens from before the warm-up: health says
    NOT_SERVING and a request is UNAVAILABLE until every shape has run."""
    runtime.keep_freed_buffers()  # state blocks are multi-MB: no page faults per copy
    async with AsyncExitStack() as stack:
        await streams.ensure_streams(
            nc.jetstream(),
            duplicate_window_s=config.duplicate_window_s,
            blocks_storage=config.blocks_storage,
            replicas=config.nats_replicas,
            dead_letters=False,  # the readout's
        )
        publisher = await BlockPublisher.open(
            nc, model=model.name, timeout_s=config.publish_timeout_s
        )
        on_device = config.data_plane in (locator.LOCAL, locator.CUDA_IPC)  # rows stay there
        plans = PlanTable(
            PlanTableMetrics(metrics), plan_ttl_s=config.block_ttl_s, host_rows=not on_device
        )
        held = _slots(config, model)
        if isinstance(held, DeviceArena):
            stack.callback(held.close)
            releases = await serve_releases(nc, held)
            stack.push_async_callback(releases.unsubscribe)
        algorithm = envelope.forward_state_algorithm(config.forward_state_digest)
        sealer = Sealer(signer, model.identity, config.block_ttl_s, algorithm)
        capture_metrics = CaptureMetrics(metrics)
        if held is not None:
            capture_metrics.slots_held.set_function(held.held)
        forward = _forward(model, plans, config, capture_metrics)
        executor, batcher = await _batcher(stack, forward, config, capture_metrics)
        plane = data_plane(config, publisher, sealer, held)
        service = CaptureService(model, plans, batcher, plane, capture_metrics, config=config)
        port, health_servicer = await _serve(stack, service, config)
        # Listening already: requests meanwhile get UNAVAILABLE (CaptureWarmingUp).
        await _warm_up(forward, executor, config, capture_metrics)
        service.mark_ready()
        # ready while NATS answers a round trip: a stalled server leaves the connection up
        readiness = await stack.enter_async_context(
            probing(
                Readiness(nats_state),
                {"nats": functools.partial(round_trip, nc)},
                config.ready_timeout_s,
            )
        )
        await follow_in_health(health_servicer, ("", CAPTURE_SERVICE), readiness)
        log.info(
            "capture service listening",
            host=config.bind_host,
            port=port,
            model=model.name,
            token=config.token_file is not None,
            data_plane=config.data_plane,
        )
        yield RunningCapture(port, service, plans, held if isinstance(held, SlotPool) else None)


async def main() -> None:
    config = CaptureConfig.from_env()
    if config.data_plane == locator.LOCAL:  # no readout here could ever reach the rows
        raise runtime.ConfigError(
            "STATEBLOCK_DATA_PLANE=local: a capture process of its own serves `bus` or "
            "`host`; `stateblock up` runs the local data plane"
        )
    shutdown, metrics = runtime.service_started(config.log_level)
    model = await load_service_model(config, dtype=parse_dtype(config.dtype))
    if config.data_plane == locator.CUDA_IPC and model.lm_head.device.type != "cuda":
        raise runtime.ConfigError(
            f"STATEBLOCK_DATA_PLANE=ipc shares a CUDA device's rows with other processes; "
            f"this capture's are on {model.lm_head.device.type}: serve `host` there"
        )
    signer = load_or_generate_signer(config.key_dir)
    log.info("signing key", key_id=signer.key_id, key_dir=str(config.key_dir))
    async with AsyncExitStack() as stack:
        # drained after the servers have stopped
        nc, state = await connected(stack, config.nats_url, "capture_svc", metrics)
        await stack.enter_async_context(
            runtime.metrics_server(metrics, config.metrics_port, config.metrics_host)
        )
        await stack.enter_async_context(runtime.loop_lag(metrics))
        await stack.enter_async_context(
            running_capture(
                config, nc=nc, model=model, signer=signer, metrics=metrics, nats_state=state
            )
        )
        await shutdown.wait()
        log.info("shutting down", grace_s=config.grace_s)
