"""The gateway's outcome watcher against a real nats-server: it answers only from what the
registry stored and a trusted readout key signed; forged commits and rejections, stored or
refused, neither answer a request nor fail it."""

from __future__ import annotations

import asyncio

import nats
import pytest

from gateway.commits import CommitWatcher
from gateway.errors import ReadoutFailed
from registry import CommitTimeout, Registry
from stateblock.protocol import outcomes
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.v1 import commit_pb2 as pb

WORKER = Signer.generate()
FORGER = Signer.generate()
TRUST = TrustStore([WORKER.public_key])


@pytest.fixture
async def registry(nc) -> Registry:
    return await Registry.open(nc.jetstream(), outcome_trust=TRUST)


def commit(block_id: str, tokens=(5, 6, 7), signer: Signer | None = WORKER) -> pb.Commit:
    lane = pb.LaneAnswer(lane_index=0, token_ids=list(tokens), eos_pos=len(tokens))
    record = pb.Commit(block_id=block_id, request_id="req", lanes=[lane], worker_id="w")
    if signer is not None:
        outcomes.sign(record, signer)
    return record


def rejection(block_id: str, reason: str = "expired", signer: Signer = WORKER) -> pb.Rejection:
    record = pb.Rejection(block_id=block_id, request_id="req", reason=reason, worker_id="w")
    outcomes.sign(record, signer)
    return record


def kv_subject(block_id: str) -> str:
    return f"$KV.STATEBLOCK_REGISTRY.{block_id}"


def committed_entry(record: pb.Commit) -> bytes:
    entry = pb.RegistryEntry(state=pb.CLAIM_STATE_COMMITTED, block_id=record.block_id)
    entry.commit.CopyFrom(record)
    return entry.SerializeToString()


async def test_signed_commits_answer_and_releases_do_not(registry):
    async with CommitWatcher.open(registry, TRUST) as watcher:
        watch = asyncio.create_task(watcher.watch_commit("b1", timeout=10))
        claim = await registry.claim("b1", "w1", lease_s=30)
        await registry.release(claim)  # a delete: not an answer
        claim = await registry.claim("b1", "w2", lease_s=30)
        await asyncio.sleep(0.05)
        assert not watch.done()
        await registry.commit(claim, commit("b1", tokens=(4,)))
        got = await asyncio.wait_for(watch, 5)
        assert list(got.lanes[0].token_ids) == [4]
        # committed before anyone waited: answered from what the watch kept
        claim = await registry.claim("b2", "w1", lease_s=30)
        await registry.commit(claim, commit("b2"))
        await asyncio.sleep(0.2)
        got = await asyncio.wait_for(watcher.watch_commit("b2", timeout=5), 1)
        assert got.block_id == "b2"


async def test_a_signed_rejection_fails_the_request_with_its_reason(registry):
    async with CommitWatcher.open(registry, TRUST) as watcher:
        claim = await registry.claim("b1", "w1", lease_s=30)
        await registry.reject(claim, rejection("b1", "limits"))
        with pytest.raises(ReadoutFailed, match="limits"):
            await watcher.watch_commit("b1", timeout=5)


async def test_a_commit_refused_by_jetstream_is_never_served(nc, registry):
    """A forged commit: a publish with a stale expected revision is refused by JetStream
    (wrong last sequence) yet seen on the bucket's plain subject; it is never served."""
    async with CommitWatcher.open(registry, TRUST) as watcher:
        claim = await registry.claim("b1", "w1", lease_s=30)
        forged = committed_entry(commit("b1", tokens=(66,)))  # even validly signed
        js = nc.jetstream()
        with pytest.raises(nats.js.errors.APIError):
            await js.publish(
                kv_subject("b1"),
                forged,
                headers={"Nats-Expected-Last-Subject-Sequence": str(claim.revision - 1)},
            )
        await registry.commit(claim, commit("b1", tokens=(7,)))
        got = await watcher.watch_commit("b1", timeout=5)
        assert list(got.lanes[0].token_ids) == [7]


@pytest.mark.parametrize("signer", [None, FORGER], ids=["unsigned", "untrusted_key"])
async def test_a_stored_forged_commit_is_ignored(nc, registry, signer):
    """A forger with write access stores a commit of its own under a genuine block id: it is
    not signed by a trusted readout key, so the request waits on (and times out here)."""
    async with CommitWatcher.open(registry, TRUST) as watcher:
        await nc.jetstream().publish(kv_subject("b1"), committed_entry(commit("b1", signer=signer)))
        with pytest.raises(CommitTimeout):
            await watcher.watch_commit("b1", timeout=1.5)  # the re-read sees it too: ignored
        assert watcher.untrusted._value.get() >= 1


async def test_a_forged_rejection_fails_no_request(nc, registry):
    """A rejection a forger publishes (on the rejected subject, or stored in the
    registry under a trusted-looking reason) fails nothing; the genuine commit answers."""
    async with CommitWatcher.open(registry, TRUST) as watcher:
        watch = asyncio.create_task(watcher.watch_commit("b1", timeout=10))
        await nc.publish(
            "stateblock.rejected.bad_signature",
            b"x",
            headers={"Stateblock-Block-Id": "b1", "Stateblock-Reason": "bad_signature"},
        )
        forged = pb.RegistryEntry(state=pb.CLAIM_STATE_REJECTED, block_id="b1")
        forged.rejection.CopyFrom(rejection("b1", signer=FORGER))
        await nc.jetstream().publish(kv_subject("b1"), forged.SerializeToString())
        await asyncio.sleep(0.3)
        assert not watch.done()
        # the genuine worker: the forged final entry is not an outcome, so it claims over it
        claim = await registry.claim("b1", "w1", lease_s=30)
        await registry.commit(claim, commit("b1", tokens=(9,)))
        got = await asyncio.wait_for(watch, 5)
        assert list(got.lanes[0].token_ids) == [9]


async def test_a_commit_signed_for_another_block_is_ignored(nc, registry):
    """A genuine signed commit replayed under another block's key names its own block."""
    async with CommitWatcher.open(registry, TRUST) as watcher:
        await nc.jetstream().publish(kv_subject("b2"), committed_entry(commit("b1")))
        with pytest.raises(CommitTimeout):
            await watcher.watch_commit("b2", timeout=1.5)


async def test_the_watcher_rereads_the_registry_for_an_outcome_it_never_saw(registry):
    claim = await registry.claim("b1", "w1", lease_s=30)
    await registry.commit(claim, commit("b1"))  # before the watcher existed
    watcher = CommitWatcher(registry, TRUST, recheck_s=0.1)  # not watching: sees nothing
    got = await watcher.watch_commit("b1", timeout=5)
    assert got.block_id == "b1"
    claim = await registry.claim("b3", "w1", lease_s=30)
    await registry.commit(claim, commit("b3", signer=FORGER))
    with pytest.raises(CommitTimeout):
        await watcher.watch_commit("b3", timeout=0.5)


async def test_a_genuine_outcome_a_forger_overwrote_is_still_found(nc, registry):
    """A forger's write that lands after the genuine commit replaces it as the key's last
    value (a retry following its block after a NATS outage would wait for a commit that is
    not the bucket's last word). The key keeps its
    revisions: a late reader finds the newest trusted outcome, and a redelivery is still
    dropped as committed (never run twice)."""
    from registry import AlreadyCommitted

    claim = await registry.claim("b9", "w1", lease_s=30)
    await registry.commit(claim, commit("b9", tokens=(8, 9)))
    forged = pb.RegistryEntry(state=pb.CLAIM_STATE_REJECTED, block_id="b9")
    forged.rejection.CopyFrom(rejection("b9", signer=FORGER))
    await nc.jetstream().publish(kv_subject("b9"), forged.SerializeToString())
    assert (await registry.get("b9")).state == pb.CLAIM_STATE_REJECTED  # the last word
    async with CommitWatcher.open(registry, TRUST) as watcher:  # a reader that saw nothing
        got = await asyncio.wait_for(watcher.watch_commit("b9", timeout=10), 5)
    assert list(got.lanes[0].token_ids) == [8, 9]
    with pytest.raises(AlreadyCommitted):
        await registry.claim("b9", "w2", lease_s=30)


async def test_every_waiter_on_one_block_gets_its_outcome(registry):
    """Retries sharing an Idempotency-Key wait on one block: each waiter is answered, and
    one that leaves (its client went away) takes no other's future with it."""
    async with CommitWatcher.open(registry, TRUST) as watcher:
        watches = [asyncio.create_task(watcher.watch_commit("b5", timeout=10)) for _ in range(5)]
        await asyncio.sleep(0.05)
        watches[0].cancel()
        claim = await registry.claim("b5", "w1", lease_s=30)
        await registry.commit(claim, commit("b5", tokens=(3,)))
        got = await asyncio.wait_for(asyncio.gather(*watches[1:]), 5)
        assert [list(c.lanes[0].token_ids) for c in got] == [[3]] * 4
        assert watcher._waiting == {}
