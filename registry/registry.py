"""The CAS registry: one KV key per block, claimed by `create`, committed by `update`.

Every write is a compare-and-swap on the key's revision, so the server, not the workers'
clocks, decides who wins: `claim` is `create` (only one worker can create the key); a
claim whose lease has expired is taken over with `update(last=rev)` (only one worker can
move that revision on); `commit` (or `reject`) is `update(last=claim_rev)`, so a worker
whose claim was taken over cannot write the block's outcome. Leases only decide *when* a takeover may be attempted; clock
skew between workers makes a takeover early or late, never a double commit.

Anyone with write access to the bucket can store bytes under a block's key, so a registry
that knows the trusted readout keys believes only what one of them signed: claims as well
as outcomes. A value that does not decode, or that no trusted key signed for its block, is
neither a lease nor an outcome; `claim` takes it over at once (its revision is what the
compare-and-swap moves on) and names it in `Claim.displaced`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import nats.errors
import nats.js.errors as js_errors
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from registry import errors
from stateblock.nats_client import retry_transient
from stateblock.protocol import outcomes
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.streams import check_replicas
from stateblock.v1 import commit_pb2 as pb

T = TypeVar("T")
# revisions kept a key: claim, renewals and the outcome, and a genuine outcome a forger's
# later write replaced (readers look for the newest trusted one)
HISTORY = 8
DEFAULT_BUCKET = "STATEBLOCK_REGISTRY"
# An entry in one of these states is the block's outcome and never changes again.
FINAL_STATES = (pb.CLAIM_STATE_COMMITTED, pb.CLAIM_STATE_REJECTED)
# A race is lost only to another writer that made progress, so a few rounds suffice.
_MAX_RACES = 8
# The watch's heartbeat. Its consumer lives in the server's memory and is gone after a
# nats-server restart; nats-py checks every two heartbeats and makes a new one after a
# check that saw none, so the watch is back within about four times this. At nats-py's
# default, 5 s, that is 10-20 s, in which every answer waits for its waiter's once-a-second
# re-read of the registry.
WATCH_HEARTBEAT_S = 0.5
# JetStream's "wrong last sequence" codes: the revision we compared against moved on.
_WRONG_LAST = (10071, 10164)
_KEY = re.compile(r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")
_STATES = (pb.CLAIM_STATE_CLAIMED, *FINAL_STATES)
# What `claim` found under the key and took over (Claim.displaced): nobody's entry.
UNDECODABLE = "undecodable"  # bytes that are no registry entry
UNTRUSTED_CLAIM = "untrusted_claim"  # a claim no trusted readout key signed for the block
UNTRUSTED_OUTCOME = "untrusted_outcome"  # a commit or rejection no trusted key signed


@dataclass(frozen=True)
class Claim:
    """Proof of a live claim: commit and renew compare against `revision`."""

    block_id: str
    worker_id: str
    revision: int
    lease_expires_at: float  # unix seconds, the claimer's clock
    attempt: int  # 1 for the first claim, +1 per takeover
    displaced: str = ""  # the untrusted entry this claim replaced (UNDECODABLE, ...), if any


def _key(block_id: str) -> str:
    if not _KEY.match(block_id):
        raise ValueError(f"block id {block_id!r} is not a valid KV key")
    return block_id


def _timestamp(unix_s: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(unix_s * 1e9))
    return ts


def _wrong_last(e: Exception) -> bool:
    if isinstance(e, js_errors.KeyWrongLastSequenceError):
        return True
    return isinstance(e, js_errors.APIError) and e.err_code in _WRONG_LAST


@contextmanager
def _nats_errors(what: str) -> Iterator[None]:
    """Anything NATS raises that the CAS logic did not handle means NATS is unusable."""
    try:
        yield
    except (TimeoutError, nats.errors.Error) as e:
        if _wrong_last(e):  # callers handle these inside; one escaping here is a bug
            raise errors.RevisionConflict(f"{what}: {e}") from e
        raise errors.RegistryUnavailable(f"{what}: {e}") from e


def _decode(block_id: str, value: bytes | None) -> pb.RegistryEntry:
    entry = pb.RegistryEntry()
    try:
        entry.ParseFromString(value or b"")
    except DecodeError as e:
        raise errors.RegistryError(f"block {block_id}: undecodable registry entry") from e
    if entry.state not in _STATES:
        raise errors.RegistryError(f"block {block_id}: registry entry has no known state")
    return entry


def updates_subject(bucket: str = DEFAULT_BUCKET) -> str:
    """The subject every write to the bucket is published on. A plain subscription to it
    sees each claim and commit as it lands, with no consumer to create."""
    return f"$KV.{bucket}.>"


def parse_update(
    subject: str, data: bytes, headers: dict | None
) -> tuple[str, pb.RegistryEntry | None]:
    """(block_id, entry) for a write seen on `updates_subject`; entry is None for a delete
    or purge (a released claim). Raises RegistryError for an undecodable entry."""
    block_id = subject.split(".", 2)[2]  # $KV.<bucket>.<key>: neither has a dot
    if headers and headers.get("KV-Operation") in ("DEL", "PURGE"):
        return block_id, None
    return block_id, _decode(block_id, data)


class Registry:
    def __init__(
        self,
        kv: KeyValue,
        bucket: str,
        *,
        js: JetStreamContext | None = None,
        clock: Callable[[], float] = time.time,
        outcome_trust: TrustStore | None = None,
        signer: Signer | None = None,
        retry_s: float = 5.0,
    ) -> None:
        self._kv = kv
        self._retry_s = retry_s  # how long one KV request is retried through an election
        self._js = js
        # The readout keys whose claims and outcomes stand: an entry no trusted key signed
        # (a forger's) is claimed over at once. None: every entry that decodes stands.
        self._outcome_trust = outcome_trust
        self._signer = signer  # signs this registry's claims and renewals (a readout key)
        self._bucket = bucket
        self._clock = clock  # injectable so tests expire leases without sleeping

    @property
    def updates_subject(self) -> str:
        return updates_subject(self._bucket)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str = DEFAULT_BUCKET,
        *,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        outcome_trust: TrustStore | None = None,
        signer: Signer | None = None,
        replicas: int | None = None,
    ) -> Registry:
        """Bind to the bucket, creating it (file storage, HISTORY revisions a key, `replicas`
        copies on a JetStream cluster) if it does not exist; an existing bucket with another
        replica count is a StreamConflict when `replicas` is given.

        ttl_s ages entries out; it must exceed block expiry plus the longest lease, or an
        aged-out block could be claimed and committed a second time on redelivery.
        """
        with _nats_errors(f"open bucket {bucket}"):
            try:
                kv = await js.key_value(bucket)
            except js_errors.BucketNotFoundError:
                # Creating with an identical config is idempotent, so racing services agree.
                config = KeyValueConfig(
                    bucket=bucket,
                    history=HISTORY,
                    ttl=ttl_s,
                    storage=StorageType.FILE,
                    replicas=replicas or 1,
                )
                kv = await js.create_key_value(config)
            if replicas is not None:
                info = await js.stream_info(f"KV_{bucket}")
                check_replicas(info.config.name, info.config.num_replicas, replicas)
        return cls(kv, bucket, js=js, clock=clock, outcome_trust=outcome_trust, signer=signer)

    async def claim(self, block_id: str, worker_id: str, lease_s: float) -> Claim:
        """Claim the block for lease_s seconds, taking over an expired lease or an entry no
        trusted key wrote (named in the claim's `displaced`).

        Raises AlreadyCommitted (drop the redelivery), AlreadyClaimed (a live lease
        elsewhere: let the message be redelivered later), or RevisionConflict.
        """
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        key = _key(block_id)
        with _nats_errors(f"claim {block_id}"):
            for _ in range(_MAX_RACES):
                now = self._clock()
                fresh = self._claimed(block_id, worker_id, now + lease_s, attempt=1)
                try:
                    rev = await self._kv_call(
                        partial(self._kv.create, key, fresh.SerializeToString())
                    )
                    return Claim(block_id, worker_id, rev, now + lease_s, 1)
                except js_errors.KeyWrongLastSequenceError:
                    pass  # the key exists: an outcome, a lease, or nobody's entry
                try:
                    current = await self._kv_call(lambda: self._kv.get(key))
                except js_errors.KeyNotFoundError:
                    continue  # released between our create and get: race again
                attempt, displaced = await self._takeover(block_id, current.value, now)
                takeover = self._claimed(block_id, worker_id, now + lease_s, attempt)
                try:
                    rev = await self._kv_call(
                        partial(
                            self._kv.update,
                            key,
                            takeover.SerializeToString(),
                            last=current.revision,
                        )
                    )
                    return Claim(block_id, worker_id, rev, now + lease_s, attempt, displaced)
                except js_errors.KeyWrongLastSequenceError:
                    continue  # another worker moved first; re-read what it wrote
        raise errors.RevisionConflict(f"claim {block_id}: lost {_MAX_RACES} races in a row")

    async def _takeover(self, block_id: str, value: bytes | None, now: float) -> tuple[int, str]:
        """(attempt, displaced) for a claim over the key's current `value`; raises
        AlreadyCommitted or AlreadyClaimed where a trusted entry still stands.

        Under an entry nobody trusted wrote, the key's stored revisions decide: a genuine
        outcome it replaced still ends the block, and the attempt count follows the genuine
        claims, not the forger's number."""
        try:
            entry = _decode(block_id, value)
            displaced = self._untrusted(block_id, entry)
        except errors.RegistryError:
            entry, displaced = None, UNDECODABLE
        if entry is not None and not displaced:
            if entry.state in FINAL_STATES:
                raise errors.AlreadyCommitted(block_id)
            left = entry.lease_expires_at.ToNanoseconds() / 1e9 - now
            if left > 0:
                raise errors.AlreadyClaimed(block_id, entry.worker_id, left)
            return entry.attempt + 1, ""
        genuine = [e for e in await self.history(block_id) if not self._untrusted(block_id, e)]
        if any(e.state in FINAL_STATES for e in genuine):
            raise errors.AlreadyCommitted(block_id)  # a forger overwrote a genuine outcome
        return max((e.attempt for e in genuine), default=0) + 1, displaced

    async def _kv_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """One KV request, repeated while JetStream elects the bucket's leader or the client
        moves to another node. Repeating is safe: a create or compare-and-swap that landed
        before its reply was lost makes the repeat fail its comparison, which each caller
        reads as the race it lost; a repeated read or delete changes nothing."""
        return await retry_transient(call, within_s=self._retry_s, what="registry")

    def _untrusted(self, block_id: str, entry: pb.RegistryEntry) -> str:
        """Why no trusted readout key stands behind `entry` ("" when one does, or when this
        registry trusts every entry that decodes)."""
        if self._outcome_trust is None:
            return ""
        try:
            if entry.state == pb.CLAIM_STATE_CLAIMED:
                outcomes.verify_claim(entry, self._outcome_trust, block_id)
            else:
                outcomes.outcome_of(entry, self._outcome_trust, block_id)
        except outcomes.UntrustedClaim:
            return UNTRUSTED_CLAIM
        except outcomes.UntrustedOutcome:
            return UNTRUSTED_OUTCOME
        return ""

    async def renew(self, claim: Claim, lease_s: float) -> Claim:
        """Extend a live claim's lease (for readouts longer than the lease)."""
        now = self._clock()
        entry = self._claimed(claim.block_id, claim.worker_id, now + lease_s, claim.attempt)
        rev = await self._swap(claim, entry, f"renew {claim.block_id}")
        return Claim(claim.block_id, claim.worker_id, rev, now + lease_s, claim.attempt)

    async def commit(self, claim: Claim, record: pb.Commit) -> int:
        """Write the commit iff the claim still holds; returns the entry's new revision.

        A lease that expired without a takeover still commits: the revision, not the
        clock, is what proves nobody else claimed the block.
        """
        return await self._finish(claim, pb.CLAIM_STATE_COMMITTED, commit=record)

    async def reject(self, claim: Claim, rejection: pb.Rejection) -> int:
        """Write the block's signed rejection iff the claim still holds (as `commit`)."""
        return await self._finish(claim, pb.CLAIM_STATE_REJECTED, rejection=rejection)

    async def _finish(
        self, claim: Claim, state: pb.ClaimState, **outcome: pb.Commit | pb.Rejection
    ) -> int:
        ((kind, record),) = outcome.items()
        if record.block_id != claim.block_id:
            raise ValueError(f"{kind} for {record.block_id!r} under a claim on {claim.block_id!r}")
        entry = pb.RegistryEntry(
            state=state,
            block_id=claim.block_id,
            worker_id=claim.worker_id,
            attempt=claim.attempt,
            **outcome,
        )
        return await self._swap(claim, entry, f"{kind} {claim.block_id}")

    async def watch_stored(
        self, cb: Callable[[str, pb.RegistryEntry | None], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """Call cb(block_id, entry) for every write the bucket *stores* from now on (entry
        None: a delete). An ordered consumer on the bucket's stream: a publish JetStream
        refused (a compare-and-swap that lost, a forger's write with a stale revision) is
        never seen, unlike on the bucket's plain subject. Returns the stop function."""

        async def on_msg(msg) -> None:
            try:
                block_id, entry = parse_update(msg.subject, msg.data, msg.headers)
            except (errors.RegistryError, IndexError):
                return  # undecodable: nobody's outcome; the gateway never trusts it
            await cb(block_id, entry)

        if self._js is None:
            raise RuntimeError("watch_stored needs a Registry made by Registry.open")
        with _nats_errors(f"watch bucket {self._bucket}"):
            sub = await self._js.subscribe(
                updates_subject(self._bucket),
                stream=f"KV_{self._bucket}",  # named: no stream lookup by subject
                cb=on_msg,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW,
                idle_heartbeat=WATCH_HEARTBEAT_S,
            )
        return sub.unsubscribe

    async def release(self, claim: Claim) -> None:
        """Give a claim back early (a readout that failed) so a redelivery can claim at once."""
        key = _key(claim.block_id)
        with _nats_errors(f"release {claim.block_id}"):
            try:
                await self._kv_call(lambda: self._kv.delete(key, last=claim.revision))
            except js_errors.APIError as e:
                if _wrong_last(e):
                    raise errors.ClaimLost(claim.block_id, claim.worker_id) from e
                raise

    async def history(self, block_id: str) -> list[pb.RegistryEntry]:
        """The key's stored revisions, newest first ([] if none): a genuine outcome that a
        forger's later write replaced is still among them (HISTORY deep).

        Read message by message from the bucket's stream (next by subject), not through
        nats-py's `KeyValue.history`: that watch can signal "no more" before the stored
        revisions reach it, and under load (CI's 2 cores) returned none at all, so a
        redelivery over a forged overwrite was claimed and read again."""
        if self._js is None:
            raise RuntimeError("history needs a Registry made by Registry.open")
        subject = f"$KV.{self._bucket}.{_key(block_id)}"
        stored: list[pb.RegistryEntry] = []
        seq = 1
        with _nats_errors(f"history {block_id}"):
            for _ in range(4 * HISTORY):  # bounded: a key keeps at most HISTORY revisions
                try:
                    msg = await self._kv_call(
                        partial(self._js.get_msg, f"KV_{self._bucket}", seq, subject, next=True)
                    )
                except js_errors.NotFoundError:
                    break  # no later revision of the key
                seq = msg.seq + 1
                try:
                    _, entry = parse_update(subject, msg.data, msg.headers)
                except errors.RegistryError:
                    continue  # bytes that are no entry (an empty write too): nobody's
                if entry is not None:  # a delete: a released claim
                    stored.append(entry)
        return stored[::-1]

    async def get(self, block_id: str) -> pb.RegistryEntry | None:
        """The block's entry, or None if it was never claimed (or was released)."""
        key = _key(block_id)
        with _nats_errors(f"get {block_id}"):
            try:
                current = await self._kv_call(lambda: self._kv.get(key))
            except js_errors.KeyNotFoundError:
                return None
        return _decode(block_id, current.value)

    async def watch_commit(self, block_id: str, timeout: float) -> pb.Commit:
        """Wait for the block's commit (the gateway's deadline); raises CommitTimeout.

        The watch delivers the key's current value first, so a commit that landed before
        the watch started is returned at once.
        """
        key = _key(block_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with _nats_errors(f"watch {block_id}"):
            watcher = await self._kv.watch(key)
            try:
                while (remaining := deadline - loop.time()) > 0:
                    try:
                        update = await watcher.updates(timeout=remaining)
                    except TimeoutError:  # nats' subclass and asyncio's own
                        break
                    # None marks the end of the initial values; deletes are released claims.
                    if update is None or update.operation is not None:
                        continue
                    try:
                        entry = _decode(block_id, update.value)
                    except errors.RegistryError:
                        continue  # nobody's entry: wait for the block's own
                    if entry.state == pb.CLAIM_STATE_COMMITTED:
                        return entry.commit
            finally:
                await watcher.stop()
        raise errors.CommitTimeout(f"no commit for block {block_id} within {timeout:g}s")

    async def _swap(self, claim: Claim, entry: pb.RegistryEntry, what: str) -> int:
        key = _key(claim.block_id)
        with _nats_errors(what):
            try:
                return await self._kv_call(
                    lambda: self._kv.update(key, entry.SerializeToString(), last=claim.revision)
                )
            except js_errors.KeyWrongLastSequenceError as e:
                raise errors.ClaimLost(claim.block_id, claim.worker_id) from e

    def _claimed(
        self, block_id: str, worker_id: str, lease_expires_at: float, attempt: int
    ) -> pb.RegistryEntry:
        entry = pb.RegistryEntry(
            state=pb.CLAIM_STATE_CLAIMED,
            block_id=block_id,
            worker_id=worker_id,
            lease_expires_at=_timestamp(lease_expires_at),
            attempt=attempt,
        )
        if self._signer is not None:
            outcomes.sign_claim(entry, self._signer)
        return entry
