"""A worker that must not hang on a block: a payload object whose chunks go while it reads it (deleted under it, aged out):
nats-py's ObjectStore.get waits for chunks with no deadline, so the worker would hold the
block, and its pull loop, forever. The chaos suite's payload deleter wedged both readout
processes of a run this way; the worker bounds the read and signs object_missing."""

from __future__ import annotations

import asyncio
import os

import nats
from nats.js.api import ObjectMeta, ObjectMetaOptions
from prometheus_client import CollectorRegistry

from capture_svc.publisher import BlockPublisher
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from registry import Registry
from stateblock.protocol import outcomes, streams
from stateblock.protocol.keys import TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import commit_pb2
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST
from tests.integration.test_readout_worker import (
    SIGNER,
    SlowEngine,
    make_block,
    make_sealed,
    publish,
    settled,
)


async def test_a_payload_whose_chunks_are_gone_ends_object_missing(
    start_nats_server, engine, serving_model
):
    server = start_nats_server(max_payload=16 * 1024)
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js)
        publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5)
        block = make_sealed(serving_model, rows_per_lane=(40, 30), seed=7)
        block_id = block.header.block_id
        objects = await streams.payload_store(js)
        assert await publisher.publish(block)  # via the object store
        info = await objects.get_info(block_id)
        # the chunks gone, the object's meta still naming them: what a reader finds when a
        # delete lands between its look at the meta and its read of the chunks
        await js.purge_stream(
            f"OBJ_{streams.PAYLOAD_BUCKET}", subject=f"$O.{streams.PAYLOAD_BUCKET}.C.{info.nuid}"
        )
        config = ReadoutServiceConfig(
            nats_url="unused", workers=1, fetch_timeout_s=0.2, lease_s=1.0, ack_wait_s=3.0
        )
        metrics = CollectorRegistry()
        async with running_readout(
            config,
            nc=nc,
            engine=engine,
            trust=TrustStore([SIGNER.public_key]),
            signer=READOUT_SIGNER,
            metrics=metrics,
        ):
            rejected = await settled(
                metrics, "stateblock_blocks_rejected_total", 1, reason="object_missing"
            )
        assert rejected == 1
        entry = await (await Registry.open(js)).get(block_id)
        assert entry.state == commit_pb2.CLAIM_STATE_REJECTED
        assert outcomes.outcome_of(entry, READOUT_TRUST, block_id).reason == "object_missing"
    finally:
        await nc.close()


async def test_a_renewal_that_swallows_its_cancel_still_lets_the_readout_commit(
    nc, engine, serving_model, monkeypatch
):
    """Python 3.11's asyncio.wait_for (under nats-py's requests) returns the result when the
    reply and a cancel arrive together, dropping the cancel: a lease renewal cancelled at
    the end of a long readout then kept renewing forever, and the worker never committed
    (the chaos suite's mixed run: a claim renewed for 22 minutes, its request a 504)."""
    real_renew, swallowed = Registry.renew, []

    async def renew_as_3_11_may(self, claim, lease_s):
        try:
            await asyncio.sleep(3600)  # until the readout ends and the renewal is cancelled
        except asyncio.CancelledError:
            if swallowed:  # once is the fault; the test's teardown cancels for good
                raise
            swallowed.append(True)  # the reply was there too: wait_for returns it
        return await real_renew(self, claim, lease_s)

    monkeypatch.setattr(Registry, "renew", renew_as_3_11_may)
    config = ReadoutServiceConfig(
        nats_url="unused", workers=1, lease_s=0.3, ack_wait_s=3.0, fetch_timeout_s=0.1
    )
    metrics = CollectorRegistry()
    async with running_readout(
        config,
        nc=nc,
        engine=SlowEngine(engine, 1.0),
        trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER,
        metrics=metrics,
    ):
        block = make_block(serving_model, seed=11)
        await publish(nc, block)
        assert await settled(metrics, "stateblock_blocks_committed_total", 1) == 1


async def test_a_payload_of_many_chunks_reads_back_whole(start_nats_server):
    """streams.read_payload (each chunk written once, not joined with `bytes +=`): every
    byte back in order, across a chunk boundary and an object of a few chunks' tail."""
    server = start_nats_server()
    nc = await nats.connect(server.url)
    try:
        objects = await streams.payload_store(nc.jetstream())
        for name, size in (("exact", 4 * 4096), ("tail", 37 * 4096 + 123), ("one", 7)):
            data = os.urandom(size)
            meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=4096))
            await objects.put(name, data, meta=meta)
            assert await streams.read_payload(objects, name) == data
    finally:
        await nc.close()
