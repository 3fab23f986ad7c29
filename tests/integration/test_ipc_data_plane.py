"""The `ipc` data plane against a real nats-server, on the CPU: rows in a span of the
capture's arena, read by the workers of this host's placement (the capture's own process
finds the arena in the registry; another process opens its CUDA handle, the GPU test's part),
spans freed on the outcome in the capture's process or through a release from another, and
rows out of reach ending `rows_missing`."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.releases import serve_releases
from readout_svc.config import ReadoutServiceConfig
from readout_svc.rows import free_slot
from readout_svc.server import running_readout
from stateblock.app.stack import StackThread, UpConfig
from stateblock.model import arena as arenas
from stateblock.model.arena import DeviceArena, rows_nbytes, share
from stateblock.model.slots import rows_digest
from stateblock.protocol import envelope, locator, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import commit_pb2
from tests.integration.conftest import READOUT_SIGNER
from tests.integration.test_local_data_plane import (
    StuckEngine,
    answers,
    captured,
    outcome,
    until,
)

SIGNER = Signer.generate()
ALGORITHM = pb.DIGEST_ALGORITHM_BLAKE3  # rows in host memory carry the configured hash


async def place(arena: DeviceArena, serving_model, seed: int, ttl_s: float = 60.0):
    """What the ipc plane does before it publishes: a span, the rows in it, the header."""
    layout, rows = captured(serving_model, seed, (5, 9))
    block_id, now = f"block-ipc-{seed}-{time.time_ns()}", time.time()
    offset = await arena.reserve(block_id, rows_nbytes(layout), now + ttl_s, 1.0)
    arena.fill(offset, block_id, rows)
    header = envelope.signed_header(
        layout, rows_digest(rows, ALGORITHM), ALGORITHM,
        request_id=layout.lanes[0].request_id, identity=serving_model.identity,
        sampling=[pb.SamplingParams() for _ in layout.lanes], signer=SIGNER, ttl_s=ttl_s,
        block_id=block_id, now=now,
        locator=locator.ipc_locator(arenas.ipc_placement(), share(arena), offset),
    )  # fmt: skip
    return header, rows


async def publish(nc, header: pb.StateBlockHeader) -> None:
    subject = streams.placement_subject(MODEL, header.locator.placement)
    data = envelope.serialize_block(pb.StateBlock(header=header))
    await nc.jetstream().publish(subject, data, headers={"Nats-Msg-Id": header.block_id})


@asynccontextmanager
async def readout(nc, engine, **kw):
    config = ReadoutServiceConfig(
        nats_url="unused", workers=2, fetch_timeout_s=0.2, retry_delay_s=0.2, data_plane="ipc",
        **kw,
    )  # fmt: skip
    async with running_readout(
        config, nc=nc, engine=engine, trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER, metrics=CollectorRegistry(),
    ) as running:  # fmt: skip
        yield running


@pytest.fixture
def arena():
    a = DeviceArena(1 << 20, device="cpu", slots=4)
    yield a
    a.close()


async def test_a_block_is_read_from_its_span_and_the_span_freed(nc, engine, serving_model, arena):
    async with readout(nc, engine):
        header, rows = await place(arena, serving_model, 1)
        await publish(nc, header)
        state, commit = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_COMMITTED
        assert commit.forward_state_digest == rows_digest(rows, ALGORITHM)
        await until(lambda: arena.held() == 0)


async def test_a_release_frees_the_span_of_its_block_alone(nc, arena):
    releases = await serve_releases(nc, arena)
    try:
        far = time.time() + 60
        first = await arena.reserve("first", 100, far, 1.0)
        second = await arena.reserve("second", 100, far, 1.0)
        subject = streams.release_subject(arena.instance_id)
        await nc.publish(subject, b"not a release")
        await nc.publish(subject, streams.release_message("someone-else", first))
        await nc.publish(subject, streams.release_message("second", second))
        await until(lambda: arena.held() == 1)
        await nc.flush()
        await asyncio.sleep(0.2)
        assert arena.held() == 1 and not arena.free(second, "second")
        assert arena.free(first, "first")
    finally:
        await releases.unsubscribe()


async def test_a_reader_in_another_process_releases_the_span_over_nats(nc, serving_model, arena):
    """Out of the capture's process (the arena not in its registry), the outcome's free is
    a release on the arena's subject, which the capture hears."""
    releases = await serve_releases(nc, arena)
    try:
        header, _ = await place(arena, serving_model, 2)
        del arenas.ARENAS[arena.instance_id]  # the reader's process: not the capture's
        free_slot(None, header, nc)
        await until(lambda: arena.held() == 0)
    finally:
        arenas.ARENAS[arena.instance_id] = arena
        await releases.unsubscribe()


@pytest.mark.parametrize("lost", ["another_process", "span_reused"])
async def test_rows_out_of_reach_or_written_over_end_rows_missing(
    nc, engine, serving_model, arena, lost
):
    header, rows = await place(arena, serving_model, 3)
    if lost == "another_process":  # a CPU arena is never shared: no handle to open
        del arenas.ARENAS[arena.instance_id]
    else:  # the span freed and taken by other rows before this block was read
        arena.free(header.locator.cuda_ipc.rows_offset_bytes, header.block_id)
        other = await arena.reserve("other", rows.numel() * 4, time.time() + 60, 1.0)
        arena.fill(other, "other", torch.randn_like(rows))
    try:
        async with readout(nc, engine):
            await publish(nc, header)
            state, rejection = await outcome(nc, header.block_id)
    finally:
        arenas.ARENAS[arena.instance_id] = arena
    assert state == commit_pb2.CLAIM_STATE_REJECTED and rejection.reason == "rows_missing"


def test_ipc_answers_are_the_bus_answers(stack, decoder_dir, tmp_path):
    """`stateblock up` on the ipc plane (capture and readout in one process, the arena in
    its registry): the bus's answers, and every span back."""
    config = UpConfig(
        data_dir=tmp_path, http_port=0, grpc_port=0, workers=2, decoder_dir=decoder_dir,
        request_timeout_s=30.0, data_plane="ipc",
    )  # fmt: skip
    runner = StackThread(config)
    runner.start()
    try:
        assert answers(runner.urls.http) == answers(stack.urls.http)
        (arena,) = arenas.ARENAS.values()
        assert arena.held() == 0
    finally:
        runner.stop()
    assert not arenas.ARENAS  # closed with its capture


async def test_a_worker_that_dies_holding_a_span_leaks_nothing(nc, engine, serving_model, arena):
    """Its workers cancelled mid-readout (claim and delivery left behind): the block comes
    back after ack_wait, another process's worker takes the lapsed claim over, commits,
    and the span goes back."""
    stuck = StuckEngine(engine)
    timing = {"lease_s": 0.6, "ack_wait_s": 1.0, "grace_s": 0.05}
    header, _ = await place(arena, serving_model, 4)
    async with readout(nc, stuck, **timing):
        await publish(nc, header)
        assert await asyncio.to_thread(stuck.started.wait, 20)
        asyncio.get_running_loop().call_later(0.5, stuck.release.set)
    assert arena.held() == 1
    async with readout(nc, engine, **timing):
        state, _ = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_COMMITTED
        await until(lambda: arena.held() == 0)
