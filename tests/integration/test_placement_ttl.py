"""A placement's headers carry a message TTL, so a placement that died leaves nothing behind:
its rows died with its process, its consumer is deleted once idle, and its headers leave the
blocks stream (a work queue without an age limit) once their block has expired and a grace
has passed. Against a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from capture_svc.publisher import BlockPublisher
from stateblock.protocol import envelope, layouts, locator, streams
from stateblock.protocol.keys import Signer
from stateblock.v1 import block_pb2 as pb

MODEL = "ttl-model"
SIGNER = Signer.generate()
IDENTITY = envelope.ModelIdentity(MODEL, b"b" * 32, b"h" * 32, b"d" * 32)


def header(placement: str, ttl_s: float) -> pb.StateBlockHeader:
    layout = layouts.make_layout("req-ttl", (3,), (8,), hidden_size=4, dtype="float32")
    return envelope.signed_header(
        layout, b"\0" * 32, pb.DIGEST_ALGORITHM_BLAKE3,
        request_id="req-ttl", identity=IDENTITY,
        sampling=[pb.SamplingParams()], signer=SIGNER, ttl_s=ttl_s,
        block_id=f"block-{placement}-{time.time_ns()}", now=time.time(),
        locator=locator.slot_locator(locator.LOCAL, placement, 0),
    )  # fmt: skip


async def stored(js, placement: str) -> int:
    info = await js.stream_info(
        streams.BLOCKS_STREAM, subjects_filter=streams.placement_subject(MODEL, placement)
    )
    return sum((info.state.subjects or {}).values())


def test_a_header_lives_its_block_s_time_and_the_grace():
    assert streams.placement_ttl_s(expires_at=100.2, now=90.0, grace_s=60.0) == 71
    assert streams.placement_ttl_s(expires_at=80.0, now=90.0, grace_s=0.0) == 1  # the least


async def test_a_dead_placement_s_headers_leave_the_stream(nc):
    js = nc.jetstream()
    await streams.ensure_streams(js)
    publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5.0, placement_grace_s=1.0)
    await publisher.publish_header(header("dead-pool", ttl_s=1.0))
    await publisher.publish_header(header("live-pool", ttl_s=60.0))
    assert await stored(js, "dead-pool") == 1
    for _ in range(300):  # 1 s of block, 1 s of grace, the server's expiry sweep
        if await stored(js, "dead-pool") == 0:
            break
        await asyncio.sleep(0.1)
    assert await stored(js, "dead-pool") == 0
    assert await stored(js, "live-pool") == 1  # a block still in its time stays


async def test_a_bus_block_carries_no_ttl(nc):
    js = nc.jetstream()
    await streams.ensure_streams(js)
    publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5.0)
    await publisher.publish_header(header("a-pool", ttl_s=60.0))
    await js.publish(streams.blocks_subject(MODEL), b"bus block")
    placed = await js.get_last_msg(
        streams.BLOCKS_STREAM, streams.placement_subject(MODEL, "a-pool")
    )
    bus = await js.get_last_msg(streams.BLOCKS_STREAM, streams.blocks_subject(MODEL))
    assert int(placed.headers["Nats-TTL"]) >= 60
    assert "Nats-TTL" not in (bus.headers or {})


async def test_an_existing_blocks_stream_gains_message_ttl_and_keeps_its_blocks(nc):
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=streams.BLOCKS_STREAM, subjects=["stateblock.blocks.>"],
            retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
        )
    )  # fmt: skip
    await js.publish(streams.blocks_subject(MODEL), b"queued before the upgrade")
    await streams.ensure_streams(js)
    info = await js.stream_info(streams.BLOCKS_STREAM)
    assert info.config.allow_msg_ttl is True
    assert info.state.messages == 1


@pytest.mark.parametrize("storage", ["file", "memory"])
async def test_the_blocks_stream_allows_message_ttl(nc, storage):
    js = nc.jetstream()
    await streams.ensure_streams(js, blocks_storage=storage)
    assert (await js.stream_info(streams.BLOCKS_STREAM)).config.allow_msg_ttl is True
