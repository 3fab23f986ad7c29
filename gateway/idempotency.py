"""Idempotency keys: a request sent again with the same key (after a timeout, a dropped
connection, a 503) gets the first request's answer and never runs twice.

The key maps to the first request's id and, once its capture answered, its block id, in a
JetStream KV bucket every gateway replica shares. A retry that finds the block id waits for
that block's outcome; one that finds the first still capturing waits for the block id; one
whose first never ran (the capture was unreachable: nothing published) runs itself. When the
first request captures again (its block was rejected for a reason not its own: the payload
lost, expired unread), the key names the new block, and a retry that saw the old one
rejected follows the new one. A key sent with other parameters is refused, as OpenAI-style
APIs do.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import nats
import nats.js.errors as js_errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from gateway.errors import DeadlineExceeded, InvalidRequest, Unavailable
from stateblock.nats_client import TRANSIENT, retry_transient

log = structlog.get_logger("gateway")
BUCKET = "STATEBLOCK_REQUESTS"
MAX_KEY_CHARS = 255
POLL_S = 0.05
RETRY_S = 20.0  # a KV call is repeated through elections (6-8 s each) this long, then 503


@dataclass(frozen=True)
class Record:
    request_id: str
    fingerprint: str  # of the request's parameters: one key, one request
    block_id: str | None = None  # set once the capture answered
    prompt_tokens: tuple[int, ...] = ()
    # wall-clock end of the owner's deadline: a record still without a block id after it
    # belongs to a request that died before its capture answered (or could not say so); one
    # whose block was rejected belongs to an owner no longer capturing it again
    expires_at: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, default=list).encode()

    @classmethod
    def decode(cls, data: bytes) -> Record:
        raw = json.loads(data)
        return cls(
            raw["request_id"],
            raw["fingerprint"],
            raw["block_id"],
            tuple(raw["prompt_tokens"]),
            raw.get("expires_at", 0.0),
        )


class KeyStore(Protocol):
    """Create-if-absent records with revisions (the KV bucket; a dict in unit tests)."""

    async def create(self, key: str, record: Record) -> int | None: ...  # None: it exists

    async def get(self, key: str) -> tuple[Record, int] | None: ...

    # the new revision, or None when `revision` is no longer the key's (another moved first)
    async def update(self, key: str, record: Record, revision: int) -> int | None: ...

    async def delete(self, key: str) -> None: ...


def store_key(model: str, key: str) -> str:
    """A KV-safe name for the client's key (any string up to MAX_KEY_CHARS)."""
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} characters.", "Idempotency-Key"
        )
    return hashlib.sha256(f"{model}\0{key}".encode()).hexdigest()


@contextmanager
def _bus(what: str) -> Iterator[None]:
    """NATS trouble reaching the keys is a 503: every call before the capture's means
    nothing ran, so the client may retry (`service._generate` keeps the one after it)."""
    try:
        yield
    except (js_errors.KeyWrongLastSequenceError, js_errors.KeyNotFoundError):
        raise  # answers, not trouble: the key exists (or not); the caller reads them
    except (*TRANSIENT, nats.errors.Error) as e:
        raise Unavailable(f"idempotency keys unreachable ({what}): {type(e).__name__}") from e


class KvKeyStore:
    """The keys in a JetStream KV bucket; each call is repeated through a leader election
    or a reconnect for up to RETRY_S (safe: a create that landed makes its repeat find the
    record, which names this request), then a 503."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def _call(self, what: str, call):
        with _bus(what):
            return await retry_transient(call, within_s=RETRY_S, what=f"idempotency {what}")

    @classmethod
    async def open(cls, js: JetStreamContext, *, ttl_s: float, replicas: int = 1) -> KvKeyStore:
        try:
            kv = await js.key_value(BUCKET)
        except js_errors.BucketNotFoundError:
            config = KeyValueConfig(
                bucket=BUCKET, history=1, ttl=ttl_s, storage=StorageType.FILE, replicas=replicas
            )
            try:
                kv = await js.create_key_value(config)
            except js_errors.BadRequestError:  # another gateway made it first
                kv = await js.key_value(BUCKET)
        return cls(kv)

    async def create(self, key: str, record: Record) -> int | None:
        try:
            return await self._call("create", lambda: self._kv.create(key, record.encode()))
        except js_errors.KeyWrongLastSequenceError:
            return None

    async def get(self, key: str) -> tuple[Record, int] | None:
        try:
            entry = await self._call("get", lambda: self._kv.get(key))
        except js_errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.operation is not None:  # deleted
            return None
        return Record.decode(entry.value), entry.revision

    async def update(self, key: str, record: Record, revision: int) -> int | None:
        try:
            return await self._call(
                "update", lambda: self._kv.update(key, record.encode(), last=revision)
            )
        except js_errors.KeyWrongLastSequenceError:
            return None

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda: self._kv.delete(key))


class OwnedKey:
    """The key of the request that runs it: its record follows the request's latest block.
    A failed update is logged, not raised: the block is published, so this request answers
    whatever happens to its key."""

    def __init__(self, store: KeyStore, name: str, record: Record, revision: int) -> None:
        self.store, self.name, self.record, self.revision = store, name, record, revision

    async def point_to(self, block_id: str, prompt_tokens: tuple[int, ...]) -> None:
        await self._update(replace(self.record, block_id=block_id, prompt_tokens=prompt_tokens))

    async def lapse(self) -> None:
        """This request captures its rejected block no more: a retry may run it anew now."""
        await self._update(replace(self.record, expires_at=time.time()))

    async def give_back(self) -> None:
        """Nothing of this request ran: a retry with the key may run it."""
        try:
            await self.store.delete(self.name)
        except Unavailable:  # else it lapses with its deadline
            pass

    async def _update(self, record: Record) -> None:
        try:
            revision = await self.store.update(self.name, record, self.revision)
        except Unavailable as e:
            log.warning("idempotency key not updated", error=str(e))
            return
        if revision is None:
            log.warning("idempotency key not updated: another request took it")
            return
        self.record, self.revision = record, revision


async def claim_or_follow(
    store: KeyStore, key: str, mine: Record, deadline: float, *, stale_block: str | None = None
) -> tuple[str, Record | int]:
    """("run", revision) when this request is the key's first (or its first never ran), or
    ("follow", record with the block id) when another request with the key owns it.
    `stale_block`: a block the caller saw rejected for a reason its owner captures again; a
    record still naming it is waited on like one whose capture has not answered yet."""
    loop = asyncio.get_running_loop()
    while True:
        revision = await store.create(key, mine)
        if revision is not None:
            return "run", revision
        found = await store.get(key)
        if found is None:
            continue  # the first gave its key back (it never ran): ours to run
        record, revision = found
        if record.request_id == mine.request_id:  # our own create, whose reply was lost
            return "run", revision
        if record.fingerprint != mine.fingerprint:
            raise InvalidRequest(
                "This Idempotency-Key was used with other request parameters.",
                "Idempotency-Key",
                "idempotency_key_reused",
            )
        if record.block_id is not None and record.block_id != stale_block:
            return "follow", record
        lapsed = record.expires_at and time.time() > record.expires_at
        if lapsed or (record.block_id is not None and not record.expires_at):
            # its owner never got past the capture (a 503 whose key could not be given
            # back), or no longer captures its rejected block again (a record without an
            # end was written by a gateway that never does): no answer was given, so the
            # key is ours, if no one else takes it first
            taken = await store.update(key, mine, revision)
            if taken is not None:
                return "run", taken
            continue
        if loop.time() > deadline:
            raise DeadlineExceeded("the first request with this Idempotency-Key is still running")
        await asyncio.sleep(POLL_S)


__all__ = [
    "KeyStore",
    "KvKeyStore",
    "OwnedKey",
    "Record",
    "Unavailable",
    "claim_or_follow",
    "store_key",
]
