"""Poisoned registry entries against a real nats-server: bytes that do not decode, claims no
trusted readout key signed, and outcomes signed by a stranger's key are neither a claim nor
an outcome. Workers claim over them by compare-and-swap and count them; a genuine claim's
live lease still stands; the request still gets its answer."""

from __future__ import annotations

import asyncio
import threading

import httpx
import nats
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.commits import CommitWatcher
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from registry import AlreadyClaimed, AlreadyCommitted, Registry
from stateblock.protocol import envelope, outcomes, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import commit_pb2 as pb
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST
from tests.integration.test_readout_worker import SIGNER, make_block, publish, settled, value
from tests.integration.test_registry import Clock

WORKER = Signer.generate()
PEER = Signer.generate()
FORGER = Signer.generate()
TRUST = TrustStore([WORKER.public_key, PEER.public_key])
FAR = 4_000_000_000.0  # a lease that lapses in 2096
UNTRUSTED = "stateblock_registry_untrusted_entries_total"


def kv_subject(block_id: str) -> str:
    return f"$KV.STATEBLOCK_REGISTRY.{block_id}"


def garbage(block_id: str) -> bytes:
    return b"\x00\xffnot a registry entry"  # field number 0: no protobuf parses it


def forged_claim(block_id: str, signer: Signer | None = None, attempt: int = 1) -> pb.RegistryEntry:
    entry = pb.RegistryEntry(
        state=pb.CLAIM_STATE_CLAIMED, block_id=block_id, worker_id="forger", attempt=attempt
    )
    entry.lease_expires_at.FromSeconds(int(FAR))
    if signer is not None:
        outcomes.sign_claim(entry, signer)
    return entry


def unsigned_claim(block_id: str) -> bytes:
    return forged_claim(block_id).SerializeToString()


def stranger_claim(block_id: str) -> bytes:
    return forged_claim(block_id, FORGER).SerializeToString()


def stranger_commit(block_id: str) -> bytes:
    record = pb.Commit(block_id=block_id, request_id="req", worker_id="forger")
    record.lanes.add(lane_index=0, token_ids=[66], eos_pos=1)
    outcomes.sign(record, FORGER)
    entry = pb.RegistryEntry(state=pb.CLAIM_STATE_COMMITTED, block_id=block_id)
    entry.commit.CopyFrom(record)
    return entry.SerializeToString()


# (kind counted, how the poison is made)
POISONS = [
    ("undecodable", garbage),
    ("untrusted_claim", unsigned_claim),
    ("untrusted_claim", stranger_claim),
    ("untrusted_outcome", stranger_commit),
]
POISON_IDS = ["garbage", "unsigned_claim", "stranger_claim", "stranger_commit"]


async def poison(nc, block_id: str, make) -> None:
    await nc.jetstream().publish(kv_subject(block_id), make(block_id))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def ours(nc, clock) -> Registry:
    return await Registry.open(nc.jetstream(), clock=clock, outcome_trust=TRUST, signer=WORKER)


@pytest.fixture
async def peer(nc, clock) -> Registry:
    return await Registry.open(nc.jetstream(), clock=clock, outcome_trust=TRUST, signer=PEER)


@pytest.mark.parametrize(("kind", "make"), POISONS, ids=POISON_IDS)
async def test_a_poisoned_key_is_claimed_over_and_named(nc, ours, peer, kind, make):
    await poison(nc, "b1", make)
    claim = await ours.claim("b1", "w1", lease_s=30)
    assert claim.displaced == kind and claim.attempt == 1
    entry = await ours.get("b1")
    assert entry.worker_id == "w1" and entry.key_id == WORKER.key_id
    with pytest.raises(AlreadyClaimed):  # our signed claim is a lease the peer respects
        await peer.claim("b1", "w2", lease_s=30)


async def test_claims_are_signed_and_a_genuine_live_claim_stands(nc, ours, peer, clock):
    held = await peer.claim("b1", "peer", lease_s=30)
    entry = await ours.get("b1")
    outcomes.verify_claim(entry, TRUST, "b1")  # signed by the peer's readout key
    with pytest.raises(AlreadyClaimed) as info:
        await ours.claim("b1", "w1", lease_s=30)
    assert info.value.holder == "peer"
    held = await peer.renew(held, lease_s=30)  # a renewal is signed too
    outcomes.verify_claim(await ours.get("b1"), TRUST, "b1")
    clock.now += 31  # the genuine lease lapsed: an ordinary takeover, nothing displaced
    taken = await ours.claim("b1", "w1", lease_s=30)
    assert taken.displaced == "" and taken.attempt == 2


async def test_a_genuine_claim_replayed_under_another_block_is_no_lease(nc, ours, peer):
    await peer.claim("b1", "peer", lease_s=30)
    replay = (await ours.get("b1")).SerializeToString()
    await nc.jetstream().publish(kv_subject("b2"), replay)
    claim = await ours.claim("b2", "w1", lease_s=30)
    assert claim.displaced == "untrusted_claim"


@pytest.mark.parametrize(("kind", "make"), POISONS, ids=POISON_IDS)
async def test_poison_over_a_live_claim_is_claimed_over_at_once(nc, ours, peer, kind, make):
    """The holder's commit is refused (the revision moved); a worker claims over the poison
    without waiting for the holder's lease, keeping the attempt count of the genuine ones."""
    await peer.claim("b1", "peer", lease_s=30)
    await poison(nc, "b1", make)
    claim = await ours.claim("b1", "w1", lease_s=30)
    assert claim.displaced == kind and claim.attempt == 2


async def test_poison_over_a_genuine_outcome_never_reopens_the_block(nc, ours, peer):
    claim = await peer.claim("b1", "peer", lease_s=30)
    record = pb.Commit(block_id="b1", request_id="req", worker_id="peer")
    outcomes.sign(record, PEER)
    await peer.commit(claim, record)
    await poison(nc, "b1", garbage)
    with pytest.raises(AlreadyCommitted):
        await ours.claim("b1", "w1", lease_s=30)
    history = await ours.history("b1")  # the garbage revision is nobody's entry
    assert [e.state for e in history] == [pb.CLAIM_STATE_COMMITTED, pb.CLAIM_STATE_CLAIMED]


async def test_a_forged_attempt_count_is_not_believed(nc, ours):
    await nc.jetstream().publish(
        kv_subject("b1"), forged_claim("b1", attempt=2**32 - 1).SerializeToString()
    )
    claim = await ours.claim("b1", "w1", lease_s=30)
    assert claim.attempt == 1


class GatedEngine:
    """The reference engine, holding every readout until the test opens the gate."""

    name = "gated"

    def __init__(self, inner) -> None:
        self._inner = inner
        self.identity = inner.identity
        self.gate = threading.Event()

    def readout(self, lanes):
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return self._inner.readout(lanes)

    def warm_up(self) -> None:
        pass


@pytest.fixture
async def workers(nc, engine):
    """Two readout workers (signing with READOUT_SIGNER) behind a gate, and the gateway's
    outcome watcher trusting their key."""
    metrics = CollectorRegistry()
    gated = GatedEngine(engine)
    config = ReadoutServiceConfig(
        nats_url="unused", workers=2, fetch_timeout_s=0.2, retry_delay_s=0.2
    )
    async with running_readout(
        config,
        nc=nc,
        engine=gated,
        trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER,
        metrics=metrics,
    ):
        registry = await Registry.open(nc.jetstream(), outcome_trust=READOUT_TRUST)
        async with CommitWatcher.open(registry, READOUT_TRUST) as watcher:
            yield gated, metrics, registry, watcher


@pytest.mark.parametrize(("kind", "make"), POISONS, ids=POISON_IDS)
async def test_a_request_whose_key_was_poisoned_before_the_claim_is_answered(
    nc, workers, serving_model, kind, make
):
    gated, metrics, _, watcher = workers
    gated.gate.set()
    block = make_block(serving_model, seed=21)
    await poison(nc, block.header.block_id, make)
    await publish(nc, block)
    commit = await watcher.watch_commit(block.header.block_id, timeout=20)
    outcomes.verify(commit, READOUT_TRUST, block.header.block_id)
    assert commit.request_id == block.header.request_id
    assert await settled(metrics, UNTRUSTED, 1, kind=kind) == 1
    assert await settled(metrics, "stateblock_blocks_committed_total", 1) == 1


@pytest.mark.parametrize(("kind", "make"), POISONS, ids=POISON_IDS)
async def test_a_request_whose_live_claim_was_poisoned_is_answered(
    nc, workers, serving_model, kind, make
):
    gated, metrics, registry, watcher = workers
    block = make_block(serving_model, seed=22)
    block_id = block.header.block_id
    await publish(nc, block)
    for _ in range(400):  # the worker's claim lands; its readout waits at the gate
        entry = await registry.get(block_id)
        if entry is not None and entry.state == pb.CLAIM_STATE_CLAIMED:
            break
        await asyncio.sleep(0.025)
    outcomes.verify_claim(entry, READOUT_TRUST, block_id)
    await poison(nc, block_id, make)
    gated.gate.set()
    commit = await watcher.watch_commit(block_id, timeout=20)
    outcomes.verify(commit, READOUT_TRUST, block_id)
    assert await settled(metrics, UNTRUSTED, 1, kind=kind) == 1
    assert value(metrics, "stateblock_claims_lost_total") >= 1  # the poison moved its revision
    assert await settled(metrics, "stateblock_blocks_committed_total", 1) == 1


async def test_a_forger_poisoning_every_block_on_sight_fails_no_request(stack):
    """The embedded stack and the official client: a registry writer that sees each block as
    it is published writes garbage, then a claim of its own, under its key. The request is
    answered as it would be without them, and the readout counts what it claimed over."""
    nc = await nats.connect(stack.urls.nats_admin)
    js = nc.jetstream()

    async def on_block(msg) -> None:
        block_id = envelope.parse_wire(msg.data)[0].header.block_id
        await js.publish(kv_subject(block_id), garbage(block_id))
        await js.publish(kv_subject(block_id), unsigned_claim(block_id))

    client = openai.AsyncOpenAI(base_url=f"{stack.urls.http}/v1", api_key="-", max_retries=0)
    try:
        sub = await nc.subscribe(streams.blocks_subject(MODEL), cb=on_block)
        poisoned = await client.completions.create(model=MODEL, prompt="copy: abc", max_tokens=16)
        await sub.unsubscribe()
        clean = await client.completions.create(model=MODEL, prompt="copy: abc", max_tokens=16)
    finally:
        await nc.close()
    assert poisoned.choices[0].text == clean.choices[0].text
    text = httpx.get(f"{stack.urls.http}/metrics").text
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == UNTRUSTED.removesuffix("_total")
    ]
    assert sum(s.value for s in family.samples if s.name == UNTRUSTED) >= 1
