"""The readout service assembled: N workers on one durable pull consumer; `python -m readout_svc`."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import structlog
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from readout_svc.advisories import ExhaustedBlocks
from readout_svc.cohorts import ReadoutCohorts
from readout_svc.config import ReadoutServiceConfig
from readout_svc.pull import run_worker
from readout_svc.rows import free_slot
from readout_svc.worker import EngineHealth, ReadoutWorker, WorkerMetrics
from registry import Registry
from stateblock import runtime
from stateblock.engines import ReadoutEngine, create_engine, require_engine
from stateblock.model.arena import ipc_placement
from stateblock.model.loading import load_service_model
from stateblock.model.shm import host_placement
from stateblock.model.slots import SlotPool
from stateblock.nats_client import LIVENESS, Readiness, connected, probing, round_trip
from stateblock.protocol import locator, streams
from stateblock.protocol.keys import Signer, TrustStore, load_or_generate_signer

log = structlog.get_logger("readout_svc")


@dataclass(frozen=True)
class RunningReadout:
    workers: tuple[ReadoutWorker, ...]
    metrics: WorkerMetrics


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@asynccontextmanager
async def running_readout(
    config: ReadoutServiceConfig,
    *,
    nc: nats.NATS,
    engine: ReadoutEngine,
    trust: TrustStore,
    signer: Signer,
    metrics: CollectorRegistry,
    engine_health: EngineHealth | None = None,
    slots: SlotPool | None = None,
) -> AsyncIterator[RunningReadout]:
    """`config.pull_loops(engine)` pull loops; on exit each finishes the block in hand, then
    stops. On the local data plane they read the capture's `slots` (this process's), and pull
    that placement's blocks alone."""
    runtime.keep_freed_buffers()  # state blocks are multi-MB: no page faults per copy
    if len(trust) == 0:
        raise runtime.ConfigError("the trust store is empty: no block could ever be verified")
    placement = _placement(config, slots)
    js = nc.jetstream()
    durable, registry = await _open_bus(js, config, signer, placement)
    objects = await streams.payload_store(js)
    worker_metrics = WorkerMetrics(metrics)
    base_id = config.worker_id or default_worker_id()
    stop = asyncio.Event()
    loops = config.pull_loops(engine)
    async with AsyncExitStack() as stack:
        executor, digests, readouts = await _engine_threads(
            stack, engine, config, loops, worker_metrics
        )
        # blocks whose last delivery died with its worker: ended by a signed rejection
        exhausted = ExhaustedBlocks(
            nc, registry, trust, signer, f"{base_id}-advisories", config.lease_s,
            streams.BLOCKS_STREAM, durable,
            on_rejected=functools.partial(free_slot, slots, nc=nc),
        )  # fmt: skip
        advisories = await exhausted.subscribe()
        stack.push_async_callback(advisories.unsubscribe)
        workers, tasks = [], []
        make = functools.partial(
            ReadoutWorker, engine, registry, trust, signer,
            nc=nc, objects=objects, executor=executor, digest_executor=digests,
            metrics=worker_metrics, lease_s=config.lease_s, retry_delay_s=config.retry_delay_s,
            limits=config.limits, max_deliver=config.max_deliver, engine_health=engine_health,
            readouts=readouts, slots=slots,
            host=placement if config.data_plane in (locator.HOST, locator.CUDA_IPC) else None,
        )  # fmt: skip
        for i in range(loops):
            worker = make(worker_id=f"{base_id}-w{i}")
            psub = await js.pull_subscribe_bind(durable, streams.BLOCKS_STREAM)
            stack.push_async_callback(psub.unsubscribe)
            workers.append(worker)
            tasks.append(
                asyncio.create_task(
                    run_worker(worker, psub, stop, fetch_timeout_s=config.fetch_timeout_s),
                    name=f"readout-{worker.worker_id}",
                )
            )
        log.info("readout workers running", workers=len(workers), engine=engine.name)
        try:
            yield RunningReadout(tuple(workers), worker_metrics)
        finally:
            stop.set()
            _, pending = await asyncio.wait(tasks, timeout=config.grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _placement(config: ReadoutServiceConfig, slots: SlotPool | None) -> str | None:
    """Where this process's workers read rows (None: the bus), checked against the plane."""
    if (config.data_plane == locator.LOCAL) != (slots is not None):
        raise runtime.ConfigError(
            f"STATEBLOCK_DATA_PLANE={config.data_plane} "
            + ("needs the capture's slot pool in this process" if slots is None else "has no slots")
        )
    if slots is not None:
        return slots.instance_id
    if config.data_plane == locator.HOST:
        try:
            return host_placement()
        except OSError as e:
            raise runtime.ConfigError(f"STATEBLOCK_DATA_PLANE=host: {e}") from e
    if config.data_plane == locator.CUDA_IPC:
        return ipc_placement()
    return None


async def _engine_threads(
    stack: AsyncExitStack,
    engine: ReadoutEngine,
    config: ReadoutServiceConfig,
    loops: int,
    metrics: WorkerMetrics,
) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor, ReadoutCohorts]:
    """The readout threads, the digest threads (the rows' hash runs beside the claim and
    the readout, not after them) and the cohorts that read the `loops` pull loops' blocks,
    the engine warmed up first."""
    # a thread a pull loop, and one for the long blocks' parts (readout_svc.cohorts)
    executor = stack.enter_context(ThreadPoolExecutor(loops + 1, thread_name_prefix="readout"))
    digests = stack.enter_context(ThreadPoolExecutor(loops, thread_name_prefix="readout-digest"))
    await asyncio.get_running_loop().run_in_executor(executor, engine.warm_up)
    # combining needs blocks in hand: two executions at a time (a long one never holds up
    # every other), the rest queue and go together (an engine without a cohort key reads
    # every block alone: as many at a time as workers); a block of more answer positions than
    # one maximal lane is read in parts, one execution at a time, beside the cohorts
    # one execution beside another only when full: an execution runs its depth's lanes
    # however many came (STATEBLOCK_READOUT_OVERLAP_LANES)
    combines = config.combines(engine)
    concurrency = min(2, loops) if combines else loops
    # long blocks' parts on a second set of the engine's graphs and its own stream, so a
    # cohort never waits for a part (an engine without `beside` reads them in a slot)
    beside = getattr(engine, "beside", None) if combines else None
    long_engine = beside() if beside is not None else None
    if long_engine is not None:
        await asyncio.get_running_loop().run_in_executor(executor, long_engine.warm_up)
    readouts = await stack.enter_async_context(
        ReadoutCohorts(
            engine,
            executor,
            max_lanes=config.cohort_lanes,
            concurrency=concurrency,
            overlap_lanes=config.overlap_lanes if combines else 1,
            part_positions=config.limits.answer_depth_max,
            long_engine=long_engine,
            on_cohort=metrics.cohort_blocks.observe,
        )
    )
    return executor, digests, readouts


async def _open_bus(
    js: JetStreamContext, config: ReadoutServiceConfig, signer: Signer, placement: str | None
) -> tuple[str, Registry]:
    """The streams, the readout consumer (its durable name) and the registry. Claims and
    outcomes signed by our readout keys stand; an entry none of them signed is a forger's
    (or no entry at all), claimed over at once."""
    await streams.ensure_streams(
        js,
        duplicate_window_s=config.duplicate_window_s,
        blocks_storage=config.blocks_storage,
        replicas=config.nats_replicas,
    )
    durable = await streams.ensure_readout_consumer(
        js, config.model_name, ack_wait_s=config.ack_wait_s, max_deliver=config.max_deliver,
        placement=placement,
    )  # fmt: skip
    peers = config.readout_trusted_keys_dir or config.signing_key_dir
    outcome_trust = TrustStore.from_dir(peers) if Path(peers).is_dir() else TrustStore()
    outcome_trust.add(signer.public_key)
    registry = await Registry.open(
        js, outcome_trust=outcome_trust, signer=signer, replicas=config.nats_replicas
    )
    return durable, registry


@asynccontextmanager
async def serve_health(
    host: str, port: int | None, readiness: Readiness, engine: EngineHealth
) -> AsyncIterator[int | None]:
    """grpc.health.v1 on this event loop (a wedged loop fails the probe, unlike a metrics
    thread): SERVING while NATS answers (`readiness`) and the engine does; yields the port."""
    if port is None:
        yield None
        return
    server = runtime.grpc_server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = runtime.grpc_bind(server, host, port, "readout health")
    await server.start()

    async def update(_: bool = True) -> None:
        ok = readiness.ready and engine.ok
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        await servicer.set("", status)

    # "liveness": SERVING for as long as this loop answers at all (a NATS outage is a reason
    # to take the pod out of service, not to restart it); "": ready for blocks
    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    loop = asyncio.get_running_loop()
    readiness.listeners.append(update)
    engine.listeners.append(lambda _ok: loop.create_task(update()))
    await update()
    try:
        yield bound
    finally:
        await servicer.enter_graceful_shutdown()
        await server.stop(1.0)


async def main() -> None:
    config = ReadoutServiceConfig.from_env()
    if config.data_plane == locator.LOCAL:  # the rows would be in another process's pool
        raise runtime.ConfigError(
            "STATEBLOCK_DATA_PLANE=local: a readout process of its own serves `bus` or "
            "`host`; `stateblock up` runs the local data plane"
        )
    require_engine(config.engine)  # fail closed before anything is loaded
    if config.data_plane == locator.CUDA_IPC and not torch.cuda.is_available():
        raise runtime.ConfigError(
            "STATEBLOCK_DATA_PLANE=ipc: the rows are in a capture's GPU memory, and this "
            "readout process has no CUDA device to open them on"
        )
    shutdown, metrics = runtime.service_started(config.log_level)
    trust = TrustStore.from_dir(config.trusted_keys_dir)
    signer = load_or_generate_signer(config.signing_key_dir)
    model = await load_service_model(config, lm_head_only=True)
    engine = create_engine(config.engine, model, config.device, **config.engine_kwargs())
    async with AsyncExitStack() as stack:
        # drained after the servers have stopped
        nc, state = await connected(stack, config.nats_url, "readout_svc", metrics)
        await stack.enter_async_context(
            runtime.metrics_server(metrics, config.metrics_port, config.metrics_host)
        )
        await stack.enter_async_context(runtime.loop_lag(metrics))
        engine_health = EngineHealth()
        readiness = await stack.enter_async_context(
            probing(
                Readiness(state), {"nats": functools.partial(round_trip, nc)},
                config.ready_timeout_s,
            )
        )  # fmt: skip
        await stack.enter_async_context(
            serve_health(config.metrics_host, config.health_port, readiness, engine_health)
        )
        await stack.enter_async_context(
            running_readout(
                config,
                nc=nc,
                engine=engine,
                trust=trust,
                signer=signer,
                metrics=metrics,
                engine_health=engine_health,
            )
        )
        await shutdown.wait()
        log.info("shutting down", grace_s=config.grace_s)
