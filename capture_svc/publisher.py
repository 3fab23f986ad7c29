"""Publish signed blocks to JetStream; payloads over max_payload go through the object store."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.object_store import ObjectStore

from stateblock.nats_client import describe, retry_transient
from stateblock.protocol import envelope, streams
from stateblock.v1 import block_pb2 as pb

# Room for the message headers (Nats-Msg-Id, Nats-Expected-Stream) and protocol framing.
HEADER_HEADROOM = 512
# One publish attempt's wait for its ack; a leader election may need several attempts.
ATTEMPT_TIMEOUT_S = 2.0


class PublishError(Exception):
    """JetStream did not take the block (the gateway's UNAVAILABLE)."""


class BlockPublisher:
    def __init__(
        self,
        js: JetStreamContext,
        objects: ObjectStore,
        *,
        model: str,
        max_payload: int,
        timeout_s: float,
        placement_grace_s: float = streams.PLACEMENT_TTL_GRACE_S,
    ) -> None:
        self._js = js
        self._grace = placement_grace_s
        self._objects = objects
        self._model = model
        self._subject = streams.blocks_subject(model)
        self._max_payload = max_payload
        self._timeout = timeout_s
        self._chunk = max(1024, min(streams.MAX_CHUNK, max_payload - streams.CHUNK_HEADROOM))

    @classmethod
    async def open(
        cls,
        nc: NATS,
        *,
        model: str,
        timeout_s: float,
        placement_grace_s: float = streams.PLACEMENT_TTL_GRACE_S,
    ) -> BlockPublisher:
        js = nc.jetstream()
        objects = await streams.payload_store(js)
        return cls(
            js, objects, model=model, max_payload=nc.max_payload, timeout_s=timeout_s,
            placement_grace_s=placement_grace_s,
        )  # fmt: skip

    async def publish(self, block: envelope.SealedBlock) -> bool:
        """Publish with Nats-Msg-Id = block_id; True if the rows went via the object store."""
        block_id = block.header.block_id
        via_object = block.wire_size() + HEADER_HEADROOM > self._max_payload

        async def once() -> None:
            if via_object:
                meta = ObjectMeta(
                    name=block_id, options=ObjectMetaOptions(max_chunk_size=self._chunk)
                )
                await self._objects.put(block_id, block.rows.tobytes(), meta=meta)
                data = block.object_wire(streams.PAYLOAD_BUCKET, block_id)
            else:
                data = block.wire()
            await self._send(self._subject, data, block_id)

        await self._retried(once, block_id)
        return via_object

    async def publish_header(self, header: pb.StateBlockHeader) -> None:
        """A block whose rows stay on this host (its locator says where): the header alone,
        on its placement's subject, which only that placement's workers consume. It carries
        a message TTL: should the placement die, its header leaves the stream once expired."""
        subject = streams.placement_subject(self._model, header.locator.placement)
        data = envelope.serialize_block(pb.StateBlock(header=header))
        expires_at = header.expires_at.ToNanoseconds() / 1e9

        async def once() -> None:
            ttl = streams.placement_ttl_s(
                expires_at=expires_at, now=time.time(), grace_s=self._grace
            )
            await self._send(subject, data, header.block_id, msg_ttl=ttl)

        await self._retried(once, header.block_id)

    async def _send(
        self, subject: str, data: bytes, block_id: str, msg_ttl: int | None = None
    ) -> None:
        await self._js.publish(
            subject,
            data,
            timeout=min(self._timeout, ATTEMPT_TIMEOUT_S),
            stream=streams.BLOCKS_STREAM,
            headers={"Nats-Msg-Id": block_id},
            msg_ttl=msg_ttl,
        )

    async def _retried(self, once: Callable[[], Awaitable[None]], block_id: str) -> None:
        try:
            # Repeating is safe: JetStream keeps one message per Nats-Msg-Id (its duplicate
            # window), and the object of a block is the same bytes under the same name.
            await retry_transient(once, within_s=self._timeout, what="publish block")
        except (TimeoutError, nats.errors.Error) as e:
            raise PublishError(f"publish block {block_id}: {describe(e)}") from e
