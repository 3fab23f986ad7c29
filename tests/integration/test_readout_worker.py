"""Readout workers against a real nats-server: commits, tampered blocks, duplicates, big
payloads through the object store, leases and deliveries (the service's settings:
test_readout_config.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time

import nats
import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.publisher import BlockPublisher
from readout_svc.config import ReadoutServiceConfig
from readout_svc.records import commit_record
from readout_svc.server import running_readout
from registry import Registry
from stateblock.engines import LaneRequest, lane_requests
from stateblock.model.rows import block_lanes, rows_view
from stateblock.protocol import envelope, layouts, outcomes, streams, wire
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import commit_pb2
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST

SIGNER = Signer.generate()
STRANGER = Signer.generate()


def make_block(serving_model, **kw) -> pb.StateBlock:
    return make_sealed(serving_model, **kw).message()


def make_sealed(
    serving_model, *, rows_per_lane=(6,), depth=16, ttl_s=60.0, now=None, seed=0, **seal_kw
) -> envelope.SealedBlock:
    gen = torch.Generator().manual_seed(seed)
    d = serving_model.hidden_size
    rows = torch.randn(sum(rows_per_lane), d, generator=gen)  # (total_rows, d)
    request_id = f"req-{seed}-{len(rows_per_lane)}"
    layout = layouts.make_layout(
        request_id, rows_per_lane, [depth] * len(rows_per_lane), hidden_size=d, dtype=rows.dtype
    )
    sampling = [pb.SamplingParams() for _ in rows_per_lane]
    return envelope.seal_block(
        layout,
        rows_view(rows),
        request_id=request_id,
        identity=serving_model.identity,
        sampling=sampling,
        signer=SIGNER,
        ttl_s=ttl_s,
        now=now,
        **seal_kw,
    )


@pytest.fixture
async def readout(nc, engine):
    metrics = CollectorRegistry()
    config = ReadoutServiceConfig(
        nats_url="unused", workers=2, fetch_timeout_s=0.2, retry_delay_s=0.2
    )
    async with running_readout(
        config,
        nc=nc,
        engine=engine,
        trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER,
        metrics=metrics,
    ) as running:
        yield running, metrics


async def publish(nc, block: pb.StateBlock, msg_id: str | None = None):
    js = nc.jetstream()
    headers = {"Nats-Msg-Id": msg_id or block.header.block_id}
    data = envelope.serialize_block(block)
    return await js.publish(streams.blocks_subject(MODEL), data, headers=headers)


def value(metrics: CollectorRegistry, name: str, **labels) -> float:
    return metrics.get_sample_value(name, labels) or 0.0


async def settled(metrics: CollectorRegistry, name: str, want: float, **labels) -> float:
    """The counter once it reaches `want` (the commit is visible before the ack and count)."""
    for _ in range(200):
        if value(metrics, name, **labels) >= want:
            break
        await asyncio.sleep(0.025)
    return value(metrics, name, **labels)


async def test_a_sha256_block_is_read_and_its_commit_says_so(nc, readout, serving_model):
    """A capture configured (or built) for SHA-256: the worker checks the hash its header names."""
    block = make_block(serving_model, seed=5, digest_algorithm=pb.DIGEST_ALGORITHM_SHA256)
    await publish(nc, block)
    registry = await Registry.open(nc.jetstream())
    commit = await registry.watch_commit(block.header.block_id, timeout=20)
    assert commit.forward_state_algorithm == pb.DIGEST_ALGORITHM_SHA256
    assert commit.forward_state_digest == hashlib.sha256(block.payload.inline_rows).digest()


async def test_block_committed_with_the_engine_answer(nc, readout, engine, serving_model):
    _, metrics = readout
    block = make_block(serving_model, rows_per_lane=(5, 9), depth=24)
    await publish(nc, block)
    registry = await Registry.open(nc.jetstream())
    commit = await registry.watch_commit(block.header.block_id, timeout=20)
    verified = envelope.verify(block, TrustStore([SIGNER.public_key]))
    expected = engine.readout([LaneRequest(rows=r, depth=24) for r in block_lanes(verified)])
    assert [list(lane.token_ids) for lane in commit.lanes] == [list(e.token_ids) for e in expected]
    assert [lane.eos_pos for lane in commit.lanes] == [e.eos_pos for e in expected]
    assert commit.forward_state_digest == block.header.forward_state_digest
    assert commit.forward_state_algorithm == pb.DIGEST_ALGORITHM_BLAKE3
    assert len(commit.output_digest) == 32 and commit.request_id == block.header.request_id
    assert await settled(metrics, "stateblock_blocks_committed_total", 1) == 1
    # the rows' digest was checked (in its thread) before this commit, once
    count = "stateblock_readout_stage_seconds_count"
    assert value(metrics, count, stage="digest", route="cohort") == 1
    assert value(metrics, count, stage="digest_wait", route="cohort") == 1


async def test_a_long_answer_s_commit_is_built_off_the_event_loop(
    nc, readout, engine, serving_model, monkeypatch
):
    """Over OFF_LOOP_TOKENS, the commit record is built and signed on a thread (the loop
    serves the worker's other blocks meanwhile); under it, on the loop; the same commit."""
    from readout_svc import worker as worker_module

    threads: list[int] = []
    build = worker_module.commit_record

    def recording(*args):
        threads.append(threading.get_ident())
        return build(*args)

    monkeypatch.setattr(worker_module, "commit_record", recording)
    registry = await Registry.open(nc.jetstream())
    commits = []
    for seed, bound in ((11, 10_000), (12, 8)):  # 2 lanes x 8 tokens: under, then over
        monkeypatch.setattr(worker_module, "OFF_LOOP_TOKENS", bound)
        block = make_block(serving_model, seed=seed, rows_per_lane=(5, 9), depth=8)
        await publish(nc, block)
        commit = await registry.watch_commit(block.header.block_id, timeout=20)
        outcomes.verify(commit, READOUT_TRUST, block.header.block_id)  # signed either way
        commits.append(commit)
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread and threads[1] != loop_thread
    assert [sum(len(lane.token_ids) for lane in c.lanes) > 0 for c in commits] == [True, True]


def _flip_payload(block: pb.StateBlock) -> None:
    data = bytearray(block.payload.inline_rows)
    data[17] ^= 0x01
    block.payload.inline_rows = bytes(data)


def _change_header(block: pb.StateBlock) -> None:
    block.header.sampling[0].temperature = 1.5  # a signed field, changed after signing


def _unknown_key(block: pb.StateBlock) -> None:
    envelope.sign_header(block.header, STRANGER)


UNVERIFIED = [
    ("forward_state_digest", _flip_payload),
    ("bad_signature", _change_header),
    ("unknown_key", _unknown_key),
]


@pytest.mark.parametrize(("reason", "tamper"), UNVERIFIED, ids=[t[0] for t in UNVERIFIED])
async def test_a_block_that_does_not_verify_ends_no_request(
    nc, readout, serving_model, reason, tamper
):
    """A header that fails is never claimed; rows that fail their digest (checked beside the
    claim and the readout) release the claim. Either could be a forger's copy naming a
    genuine block, so the registry holds nothing for the block, then or later: the dead
    letter on the rejected stream is marked unverified and names no block."""
    _, metrics = readout
    rejected = await nc.subscribe("stateblock.rejected.>")
    block = make_block(serving_model)
    tamper(block)
    await publish(nc, block)
    msg = await rejected.next_msg(timeout=20)
    assert msg.subject == f"stateblock.rejected.{reason}"
    assert msg.headers[streams.REASON_HEADER] == reason
    assert msg.headers[streams.VERIFIED_HEADER] == "false"
    assert streams.BLOCK_ID_HEADER not in msg.headers
    assert await settled(metrics, "stateblock_blocks_rejected_total", 1, reason=reason) == 1
    registry = await Registry.open(nc.jetstream())
    assert await registry.get(block.header.block_id) is None  # never claimed, or released
    await asyncio.sleep(0.5)  # terminated, not redelivered: still nothing, still one rejection
    assert await registry.get(block.header.block_id) is None
    assert value(metrics, "stateblock_blocks_rejected_total", reason=reason) == 1
    info = await nc.jetstream().consumer_info(streams.BLOCKS_STREAM, streams.readout_durable(MODEL))
    assert info.num_pending == 0 and info.num_ack_pending == 0


AUTHENTIC = [
    ("expired", {"ttl_s": 1.0, "now": 1_000_000_000.0}),
    ("limits", {"depth": 9000}),  # over the worker's answer envelope of 8192
]


@pytest.mark.parametrize(("reason", "kw"), AUTHENTIC, ids=[t[0] for t in AUTHENTIC])
async def test_a_genuine_block_that_cannot_be_read_ends_signed_rejected(
    nc, readout, serving_model, reason, kw
):
    """A verified header the worker will not serve ends as a rejection in the registry,
    signed by the worker's readout key, where the gateway reads it; never retried."""
    _, metrics = readout
    block = make_block(serving_model, **kw)
    await publish(nc, block)
    assert await settled(metrics, "stateblock_blocks_rejected_total", 1, reason=reason) == 1
    registry = await Registry.open(nc.jetstream())
    entry = await registry.get(block.header.block_id)
    assert entry.state == commit_pb2.CLAIM_STATE_REJECTED
    rejection = outcomes.outcome_of(entry, READOUT_TRUST, block.header.block_id)
    assert rejection.reason == reason and rejection.request_id == block.header.request_id
    assert value(metrics, "stateblock_blocks_committed_total") == 0
    # published again past the duplicate window: the outcome stands, the copy is dropped
    await publish(nc, block, msg_id=f"{block.header.block_id}-again")
    assert await settled(metrics, "stateblock_duplicate_deliveries_dropped_total", 1) == 1


async def test_block_published_twice_is_committed_once(nc, readout, serving_model):
    _, metrics = readout
    block = make_block(serving_model, seed=3)
    first = await publish(nc, block)
    again = await publish(nc, block)  # same Nats-Msg-Id: the duplicate window drops it
    assert not first.duplicate and again.duplicate
    registry = await Registry.open(nc.jetstream())
    commit = await registry.watch_commit(block.header.block_id, timeout=20)
    # past the duplicate window (a new msg id): the registry makes it a no-op
    await publish(nc, block, msg_id=f"{block.header.block_id}-redelivered")
    assert await settled(metrics, "stateblock_duplicate_deliveries_dropped_total", 1) == 1
    assert value(metrics, "stateblock_blocks_committed_total") == 1
    entry = await registry.get(block.header.block_id)
    assert entry.state == commit_pb2.CLAIM_STATE_COMMITTED and entry.commit == commit


async def test_tampered_copy_of_a_committed_block_is_rejected_not_dropped(
    nc, readout, serving_model
):
    """After the commit, a copy with the same signed header and other rows is rejected for
    its digest (as when the digest came before the claim), not dropped as a duplicate; the
    commit stays the original's."""
    _, metrics = readout
    block = make_block(serving_model, seed=5)
    await publish(nc, block)
    registry = await Registry.open(nc.jetstream())
    commit = await registry.watch_commit(block.header.block_id, timeout=20)
    rejected = await nc.subscribe("stateblock.rejected.>")
    tampered = pb.StateBlock()
    tampered.CopyFrom(block)
    _flip_payload(tampered)
    await publish(nc, tampered, msg_id=f"{block.header.block_id}-tampered")
    msg = await rejected.next_msg(timeout=20)
    assert msg.subject == "stateblock.rejected.forward_state_digest"
    assert value(metrics, "stateblock_duplicate_deliveries_dropped_total") == 0
    entry = await registry.get(block.header.block_id)
    assert entry.state == commit_pb2.CLAIM_STATE_COMMITTED and entry.commit == commit


async def test_a_block_in_another_valid_encoding_is_committed(nc, readout, serving_model):
    """Protobuf accepts the fields in any order; such bytes take the worker's full parse
    instead of the split of the canonical encoding, to the same commit."""
    block = make_block(serving_model, rows_per_lane=(3, 4), seed=8)
    payload, header = block.payload.SerializeToString(), block.header.SerializeToString()
    data = (
        b"\x12" + wire.varint(len(payload)) + payload + b"\x0a" + wire.varint(len(header)) + header
    )
    assert data != envelope.serialize_block(block) and envelope.parse_block(data) == block
    await nc.jetstream().publish(
        streams.blocks_subject(MODEL), data, headers={"Nats-Msg-Id": block.header.block_id}
    )
    registry = await Registry.open(nc.jetstream())
    commit = await registry.watch_commit(block.header.block_id, timeout=20)
    assert commit.forward_state_digest == block.header.forward_state_digest
    assert [lane.lane_index for lane in commit.lanes] == [0, 1]


async def test_model_mismatch_is_rejected(nc, readout, serving_model):
    other = dataclasses.replace(serving_model.identity, decoder_digest=b"\x00" * 32)
    block = make_block(dataclasses.replace(serving_model, identity=other), seed=4)
    rejected = await nc.subscribe("stateblock.rejected.>")
    await publish(nc, block)
    msg = await rejected.next_msg(timeout=20)
    assert msg.subject == "stateblock.rejected.model_mismatch"


async def test_block_over_max_payload_goes_through_the_object_store(
    start_nats_server, engine, serving_model
):
    server = start_nats_server(max_payload=16 * 1024)
    nc = await nats.connect(server.url)
    try:
        assert nc.max_payload == 16 * 1024
        await streams.ensure_streams(nc.jetstream())
        publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5)
        block = make_sealed(serving_model, rows_per_lane=(40, 30), seed=5)  # 70 KiB of rows
        assert len(block.wire()) > nc.max_payload
        assert await publisher.publish(block)  # True: via the object store
        config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
        trust = TrustStore([SIGNER.public_key])
        async with running_readout(
            config,
            nc=nc,
            engine=engine,
            trust=trust,
            signer=READOUT_SIGNER,
            metrics=CollectorRegistry(),
        ):
            registry = await Registry.open(nc.jetstream())
            commit = await registry.watch_commit(block.header.block_id, timeout=20)
        assert [len(lane.token_ids) <= 16 for lane in commit.lanes] == [True, True]
        objects = await streams.payload_store(nc.jetstream())
        with pytest.raises(nats.js.errors.NotFoundError):  # cleaned up after the commit
            await objects.get_info(block.header.block_id)
    finally:
        await nc.close()


class SlowEngine:
    """The reference engine behind a readout that outlasts the lease several times over."""

    name = "slow"

    def __init__(self, inner, delay_s: float) -> None:
        self._inner = inner
        self._delay = delay_s
        self.identity = inner.identity

    def readout(self, lanes):
        time.sleep(self._delay)
        return self._inner.readout(lanes)

    def warm_up(self) -> None:
        pass


class CountingEngine:
    """The reference engine, counting the blocks it was asked to read."""

    name = "counting"

    def __init__(self, inner) -> None:
        self._inner = inner
        self.identity = inner.identity
        self.calls = 0

    def readout(self, lanes):
        self.calls += 1
        return self._inner.readout(lanes)

    def warm_up(self) -> None:
        pass


async def test_the_readout_runs_beside_the_claim_and_a_refused_claim_commits_nothing(
    nc, engine, serving_model
):
    """The readout starts before the claim's answer (a KV round trip off the reply path): a
    block another worker holds is read here too, and its answer dropped unused."""
    counting = CountingEngine(engine)
    metrics = CollectorRegistry()
    config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.1)
    block = make_block(serving_model, seed=8)
    # another worker's genuine claim: signed by a readout key the workers trust
    registry = await Registry.open(nc.jetstream(), signer=READOUT_SIGNER)
    held = await registry.claim(block.header.block_id, "elsewhere", lease_s=30.0)
    async with running_readout(
        config,
        nc=nc,
        engine=counting,
        trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER,
        metrics=metrics,
    ):
        await publish(nc, block)
        cause = {"cause": "claimed_elsewhere"}
        assert await settled(metrics, "stateblock_blocks_retried_total", 1, **cause) == 1
        assert counting.calls >= 1  # it read without waiting for the claim
        entry = await registry.get(block.header.block_id)
        assert entry.worker_id == "elsewhere" and not entry.HasField("commit")
        assert value(metrics, "stateblock_blocks_committed_total") == 0
        # the holder's own commit is the block's one outcome
        verified = envelope.verify(block, TrustStore([SIGNER.public_key]))
        record = commit_record(block.header, engine.readout(lane_requests(verified)), "elsewhere")
        outcomes.sign(record, READOUT_SIGNER)
        await registry.commit(held, record)
    assert (await registry.get(block.header.block_id)).commit.worker_id == "elsewhere"
    assert value(metrics, "stateblock_blocks_committed_total") == 0


async def test_a_readout_longer_than_the_lease_keeps_its_claim(nc, engine, serving_model):
    metrics = CollectorRegistry()
    config = ReadoutServiceConfig(
        nats_url="unused", workers=2, lease_s=0.3, ack_wait_s=0.6, fetch_timeout_s=0.1
    )
    trust = TrustStore([SIGNER.public_key])
    async with running_readout(
        config,
        nc=nc,
        engine=SlowEngine(engine, 1.5),
        trust=trust,
        signer=READOUT_SIGNER,
        metrics=metrics,
    ):
        block = make_block(serving_model, seed=6)
        await publish(nc, block)
        registry = await Registry.open(nc.jetstream())
        await registry.watch_commit(block.header.block_id, timeout=20)
        assert await settled(metrics, "stateblock_blocks_committed_total", 1) == 1
    entry = await registry.get(block.header.block_id)
    assert entry.attempt == 1  # renewed, never taken over
    assert value(metrics, "stateblock_claims_lost_total") == 0
    assert value(metrics, "stateblock_duplicate_deliveries_dropped_total") == 0


async def test_readout_on_a_memory_blocks_stream_commits(nc, engine, serving_model):
    config = ReadoutServiceConfig(nats_url="unused", workers=1, blocks_storage="memory")
    trust = TrustStore([SIGNER.public_key])
    async with running_readout(
        config,
        nc=nc,
        engine=engine,
        trust=trust,
        signer=READOUT_SIGNER,
        metrics=CollectorRegistry(),
    ):
        info = await nc.jetstream().stream_info(streams.BLOCKS_STREAM)
        assert info.config.storage == "memory"
        block = make_block(serving_model, seed=7)
        await publish(nc, block)
        registry = await Registry.open(nc.jetstream())
        await registry.watch_commit(block.header.block_id, timeout=20)


async def test_a_block_whose_last_delivery_died_ends_signed_rejected(nc, serving_model):
    """Workers that die holding a block on every delivery leave JetStream's max_deliver
    advisory behind; the readout service's listener reads the block back by sequence and
    writes a signed `max_deliveries` rejection, so its request fails at once. A block whose
    header does not verify gets no registry write (it could name anyone's request)."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from readout_svc.advisories import MAX_DELIVERIES, ExhaustedBlocks

    js = nc.jetstream()
    await streams.ensure_streams(js, duplicate_window_s=60.0)
    durable = "dying-workers"
    await js.add_consumer(
        streams.BLOCKS_STREAM,
        # a subject of its own: the blocks stream is a work queue, one consumer a subject
        ConsumerConfig(durable_name=durable, filter_subject=streams.blocks_subject("dying"),
                       ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0, max_deliver=2),
    )  # fmt: skip
    registry = await Registry.open(js)
    exhausted = ExhaustedBlocks(nc, registry, TrustStore([SIGNER.public_key]), READOUT_SIGNER,
                                "adv-test", 2.0, streams.BLOCKS_STREAM, durable)  # fmt: skip
    sub = await exhausted.subscribe()
    try:
        block = make_block(serving_model, seed=41)
        forged = make_block(serving_model, seed=42)
        forged.header.request_id = "someone-else"  # the signature no longer covers it
        for b in (block, forged):
            data, headers = envelope.serialize_block(b), {"Nats-Msg-Id": b.header.block_id}
            await js.publish(streams.blocks_subject("dying"), data, headers=headers)
        psub = await js.pull_subscribe_bind(durable, streams.BLOCKS_STREAM)
        for _ in range(2):  # two deliveries of each, never acked: the workers "died"
            got = []
            for _ in range(40):
                try:
                    got += await psub.fetch(2 - len(got), timeout=0.5)
                except (nats.errors.TimeoutError, TimeoutError):
                    pass
                if len(got) == 2:
                    break
            assert len(got) == 2
        entry = None
        for _ in range(100):  # ack_wait 1 s, then the advisory, then the rejection
            entry = await registry.get(block.header.block_id)
            if entry is not None and entry.state == commit_pb2.CLAIM_STATE_REJECTED:
                break
            try:  # the workers' next pull: JetStream checks the deliveries then
                assert await psub.fetch(1, timeout=0.1) == []
            except (nats.errors.TimeoutError, TimeoutError):
                pass
        assert entry is not None and entry.state == commit_pb2.CLAIM_STATE_REJECTED
        rejection = outcomes.outcome_of(entry, READOUT_TRUST, block.header.block_id)
        assert rejection.reason == MAX_DELIVERIES
        assert rejection.request_id == block.header.request_id
        assert await registry.get(forged.header.block_id) is None  # no write for a forgery
        await psub.unsubscribe()
    finally:
        await sub.unsubscribe()
