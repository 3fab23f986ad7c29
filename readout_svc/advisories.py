"""Blocks JetStream gave up on end visibly: a signed `max_deliveries` rejection.

A worker that fails a block on its last delivery rejects it itself (`ReadoutWorker`). One
that dies or hangs on the last delivery cannot: JetStream then stops redelivering and says
so only in an advisory, `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`,
naming the block's stream sequence. Every readout process listens there in one queue group;
the one that hears it reads the block back by sequence, checks its header's signature (a
block nobody can vouch for names no request), and writes the rejection into the registry
under a claim, as a worker would: never over a commit, and after a live lease has expired.
The request then fails at once with the reason instead of waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import nats
import structlog
from nats.js import errors as js_errors

from readout_svc.records import rejection_record
from registry import AlreadyClaimed, AlreadyCommitted, ClaimLost, Registry, RegistryError
from stateblock.protocol import envelope
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.v1 import block_pb2 as pb

log = structlog.get_logger("stateblock.readout.advisories")

MAX_DELIVERIES = "max_deliveries"  # the rejection's reason
QUEUE = "stateblock-readout-advisories"


def advisory_subject(stream: str, consumer: str) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


@dataclass
class ExhaustedBlocks:
    """Ends the blocks of one consumer that ran out of deliveries (see the module doc)."""

    nc: nats.NATS
    registry: Registry
    trust: TrustStore  # the capture keys: who may have sealed a block
    signer: Signer  # this process's readout key: signs the rejection
    worker_id: str
    lease_s: float
    stream: str
    consumer: str
    claim_wait_s: float = 30.0  # at most this long for a live lease elsewhere to lapse
    # told of each block it rejected (the local data plane frees the block's slot)
    on_rejected: Callable[[pb.StateBlockHeader], None] | None = None

    async def subscribe(self):
        """The queue subscription; the caller unsubscribes (or drains) it."""
        return await self.nc.subscribe(
            advisory_subject(self.stream, self.consumer), queue=QUEUE, cb=self._on_advisory
        )

    async def _on_advisory(self, msg) -> None:
        try:
            seq = int(json.loads(msg.data)["stream_seq"])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("malformed max-deliveries advisory", error=repr(e))
            return
        try:
            outcome = await self.end(seq)
        except (RegistryError, TimeoutError, nats.errors.Error) as e:  # AlreadyClaimed too
            outcome = f"failed: {e!r}"  # the request still ends at its deadline
        log.info("max-deliveries advisory handled", stream_seq=seq, outcome=outcome)

    async def end(self, seq: int) -> str:
        """Reject the block at stream sequence `seq`; returns what happened."""
        try:
            raw = await self.nc.jetstream().get_msg(self.stream, seq)
        except js_errors.NotFoundError:
            return "gone"  # acked meanwhile, or aged out of the stream
        try:
            block, _ = envelope.parse_wire(raw.data or b"")
            header = envelope.verify_signature(block, self.trust)
        except (envelope.BlockRejected, ValueError) as e:
            return f"unverified: {e}"
        claim = await self._claim(header.block_id)
        if claim is None:
            return "already_final"
        detail = f"no worker finished it in {self.consumer}'s max_deliver deliveries"
        rejection = rejection_record(header, MAX_DELIVERIES, detail, self.worker_id, self.signer)
        try:
            await self.registry.reject(claim, rejection)
        except ClaimLost:
            return "claim_lost"  # a late worker finished it after all
        log.warning("block rejected", reason=MAX_DELIVERIES, block_id=header.block_id)
        if self.on_rejected is not None:
            self.on_rejected(header)
        return "rejected"

    async def _claim(self, block_id: str):
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.claim_wait_s
        while True:
            try:
                return await self.registry.claim(block_id, self.worker_id, self.lease_s)
            except AlreadyCommitted:
                return None
            except AlreadyClaimed:  # a hung holder: its lease lapses, then we take over
                if loop.time() >= give_up:
                    raise
                await asyncio.sleep(min(1.0, self.lease_s / 4))
