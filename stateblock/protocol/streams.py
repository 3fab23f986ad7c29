"""The JetStream layout the services share: stream, subjects, object bucket, consumer.

Every service calls `ensure_streams` at start-up; creating with an identical config is
idempotent, so services racing to start agree on one stream. An existing stream is kept
as it is, except that a storage type other than the configured one is an error: JetStream
cannot change it in place, and silently serving from the other storage would hide the
misconfiguration; and a blocks stream made without per-message TTL gains it in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import re

import nats.errors
import nats.js.errors as js_errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.object_store import ObjectStore

BLOCKS_STREAM = "STATEBLOCK_BLOCKS"
REJECTED_STREAM = "STATEBLOCK_REJECTED"
PAYLOAD_BUCKET = "STATEBLOCK_PAYLOADS"
BLOCK_ID_HEADER = "Stateblock-Block-Id"
REASON_HEADER = "Stateblock-Reason"
# "true" when the rejected block's signed header verified (its block id is genuine)
VERIFIED_HEADER = "Stateblock-Verified"
# An object store chunk travels as one message, so it must fit under max_payload with its
# headers; the JetStream default chunk is 128 KiB.
MAX_CHUNK = 128 * 1024
CHUNK_HEADROOM = 1024
# STATEBLOCK_BLOCKS_STORAGE: the blocks work queue on disk (survives a nats-server restart)
# or in memory (a faster publish with ack, docs/BENCHMARKS.md; blocks in flight are lost
# with the server, and their requests time out).
BLOCKS_STORAGE = {"file": StorageType.FILE, "memory": StorageType.MEMORY}


# A placement's consumer is deleted by the server after this long without a pull.
PLACEMENT_IDLE_S = 3600.0
# A placement's header leaves the stream (its message TTL) this long after its block
# expires: its rows live in one process or host, so once nobody can read it, nothing else
# would ever remove it from the work queue. The grace lets a live placement's worker still
# see the block and end it `expired`, which its request is told.
PLACEMENT_TTL_GRACE_S = 60.0


class StreamConflict(RuntimeError):
    """A stream exists with a setting JetStream cannot change and the config asks otherwise."""


_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def model_token(model: str) -> str:
    """The NATS subject / consumer token of a public model name. Any Hugging Face-style name
    is served ("org/model-v2.1"); a name that is not already a token keeps its readable part
    with a digest of the whole, so two names never share a token."""
    if _TOKEN.match(model):
        return model
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:64]
    return f"{readable}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def blocks_subject(model: str) -> str:
    """The subject of a model's blocks (">": every model's)."""
    return f"stateblock.blocks.{model if model == '>' else model_token(model)}"


def placement_subject(model: str, placement: str) -> str:
    """The subject of `model`'s blocks whose rows only `placement`'s workers reach
    (stateblock.protocol.locator). A token under the model's subject: the bus consumer's
    filter (the model's subject exactly) never matches it; the blocks stream stores it."""
    if not _TOKEN.match(placement) or len(placement) > 64:
        raise ValueError(f"placement {placement!r} is not a subject token")
    return f"{blocks_subject(model)}.{placement}"


def release_subject(pool: str) -> str:
    """Core NATS: the ids of blocks whose rows in the arena `pool` (the `ipc` data plane) a
    reader is done with; the capture holding the arena frees their spans (">": every
    arena's)."""
    if pool != ">" and (not _TOKEN.match(pool) or len(pool) > 64):
        raise ValueError(f"pool {pool!r} is not a subject token")
    return f"stateblock.release.{pool}"


def release_message(block_id: str, offset: int) -> bytes:
    """What a reader publishes on the release subject: the block and its span's offset."""
    return json.dumps({"block_id": block_id, "offset": offset}).encode()


def parse_release(data: bytes) -> tuple[str, int]:
    """(block id, offset) of a release message; ValueError for anything else."""
    try:
        release = json.loads(data)
        return str(release["block_id"]), int(release["offset"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a release message: {e!r}") from e


def placement_ttl_s(*, expires_at: float, now: float, grace_s: float) -> int:
    """The message TTL (whole seconds, at least 1: JetStream's least) of a placement's
    header whose block expires at unix time `expires_at`."""
    return max(1, math.ceil(expires_at - now + grace_s))


def placement_durable(model: str, placement: str) -> str:
    """The pull consumer of one placement's blocks."""
    return f"{readout_durable(model)}-{placement}"


def rejected_subject(reason: str) -> str:
    return f"stateblock.rejected.{reason}"


def readout_durable(model: str) -> str:
    return f"readout-{model_token(model)}"


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        info = await js.stream_info(config.name)
    except js_errors.NotFoundError:
        try:
            await js.add_stream(config)
            return
        except js_errors.BadRequestError:
            # Created by another service between our lookup and add: fine if it exists now
            # (with the storage we asked for; the check below says so otherwise).
            info = await js.stream_info(config.name)
    have, want = StorageType(info.config.storage).value, StorageType(config.storage).value
    if have != want:
        raise StreamConflict(
            f"stream {config.name} exists with storage {have!r}, the config asks for {want!r}; "
            f"JetStream cannot change a stream's storage: delete the stream or ask for {have!r}"
        )
    check_replicas(config.name, info.config.num_replicas, config.num_replicas)
    if config.allow_msg_ttl and not info.config.allow_msg_ttl:
        await _allow_msg_ttl(js, info.config)


async def upgrade_blocks_stream(js: JetStreamContext) -> bool:
    """Turn on per-message TTL on a blocks stream made before placement headers carried one;
    True if it changed. An admin's call, made before the services start: their NATS users
    may create streams, never change them (StreamConflict says so then)."""
    try:
        info = await js.stream_info(BLOCKS_STREAM)
    except js_errors.NotFoundError:
        return False
    if info.config.allow_msg_ttl:
        return False
    await _allow_msg_ttl(js, info.config)
    return True


async def _allow_msg_ttl(js: JetStreamContext, have: StreamConfig) -> None:
    """Turn on per-message TTL on a stream made before its config asked for it (the server
    turns it on in place and keeps the stream's messages; it never turns it off again)."""
    try:
        await js.update_stream(dataclasses.replace(have, allow_msg_ttl=True))
    except (js_errors.Error, nats.errors.Error, TimeoutError) as e:  # refused: a timeout
        raise StreamConflict(
            f"stream {have.name} does not allow per-message TTL and could not be changed "
            f"({e}): run `nats stream edit {have.name} --allow-msg-ttl` as a user that may"
        ) from e


def check_replicas(stream: str, have: int | None, want: int | None) -> None:
    """An existing stream (a KV or object bucket is one too) with another replica count is
    a start-up error that says what differs, not a silent single point of failure."""
    have, want = have or 1, want or 1
    if have != want:
        raise StreamConflict(
            f"stream {stream} has {have} replica(s), STATEBLOCK_NATS_REPLICAS asks for {want}: "
            f"change it with `nats stream edit {stream} --replicas {want}` (or ask for {have})"
        )


async def ensure_streams(
    js: JetStreamContext,
    *,
    duplicate_window_s: float = 120.0,
    payload_ttl_s: float = 3600.0,
    blocks_storage: str = "file",
    replicas: int = 1,
    dead_letters: bool = True,
) -> None:
    """The blocks work queue, the rejected-block log (with `dead_letters`: the readout
    writes it, the capture never touches it) and the payload object bucket, each with
    `replicas` copies on a JetStream cluster.

    `blocks_storage` ("file" | "memory") is the work queue's storage; raises StreamConflict
    if the queue already exists with the other one, or any of them with other replicas.
    """
    if blocks_storage not in BLOCKS_STORAGE:
        raise ValueError(
            f"blocks_storage {blocks_storage!r} is not one of {sorted(BLOCKS_STORAGE)}"
        )
    await _ensure_stream(
        js,
        StreamConfig(
            name=BLOCKS_STREAM,
            subjects=["stateblock.blocks.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=BLOCKS_STORAGE[blocks_storage],
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
            allow_msg_ttl=True,  # placement headers expire (PLACEMENT_TTL_GRACE_S)
        ),
    )
    if dead_letters:
        await _ensure_stream(
            js,
            StreamConfig(
                name=REJECTED_STREAM,
                subjects=["stateblock.rejected.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=7 * 24 * 3600.0,
                num_replicas=replicas,
            ),
        )
    await payload_store(js, ttl_s=payload_ttl_s, replicas=replicas)


async def payload_store(
    js: JetStreamContext, *, ttl_s: float = 3600.0, replicas: int | None = None
) -> ObjectStore:
    """The payload bucket; `replicas` given: created with that many, and an existing one
    checked against it (None: bind to it as it is)."""
    try:
        store = await js.object_store(PAYLOAD_BUCKET)
    except js_errors.BucketNotFoundError:
        config = ObjectStoreConfig(
            bucket=PAYLOAD_BUCKET, ttl=ttl_s, storage=StorageType.FILE, replicas=replicas or 1
        )
        try:
            return await js.create_object_store(PAYLOAD_BUCKET, config=config)
        except js_errors.BadRequestError:
            store = await js.object_store(PAYLOAD_BUCKET)
    if replicas is not None:
        info = await js.stream_info(f"OBJ_{PAYLOAD_BUCKET}")
        check_replicas(info.config.name, info.config.num_replicas, replicas)
    return store


async def read_payload(objects: ObjectStore, name: str) -> bytes:
    """The payload object's bytes. Read through `writeinto`: nats-py's plain get joins the
    chunks with `bytes +=`, quadratic in the object's size (a 176 MB block, 8 lanes of a
    4,096-token prompt at width 2,688, took 73.5 s to read on a 2-core machine; 22 MB
    1.85 s), while `writeinto` writes each chunk once."""
    out = io.BytesIO()
    await objects.get(name, writeinto=out)
    return out.getvalue()


async def payload_gone(js: JetStreamContext, objects: ObjectStore, name: str) -> bool:
    """Whether the payload object `name` can no longer be read: deleted, or its chunks no
    longer stored while its meta still names them (a delete landing, chunks aged out)."""
    try:
        info = await objects.get_info(name)
    except js_errors.NotFoundError:
        return True
    try:
        await js.get_last_msg(f"OBJ_{PAYLOAD_BUCKET}", f"$O.{PAYLOAD_BUCKET}.C.{info.nuid}")
    except js_errors.NotFoundError:
        return True
    return False


async def ensure_readout_consumer(
    js: JetStreamContext,
    model: str,
    *,
    ack_wait_s: float,
    max_deliver: int,
    placement: str | None = None,
) -> str:
    """The durable pull consumer every readout worker of `model` shares, or with
    `placement` the one of that placement's blocks (`placement_subject`; its pool lives as
    long as its process, so the server deletes the consumer once nobody has pulled from it
    for PLACEMENT_IDLE_S); returns its name."""
    durable = readout_durable(model)
    subject, idle = blocks_subject(model), None
    if placement is not None:
        subject, idle = placement_subject(model, placement), PLACEMENT_IDLE_S
        durable = placement_durable(model, placement)
    try:
        await js.consumer_info(BLOCKS_STREAM, durable)
    except js_errors.NotFoundError:
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            inactive_threshold=idle,
        )
        await js.add_consumer(BLOCKS_STREAM, config)
    return durable
