"""Where a worker finds a block's rows, and the checks before its claim.

The signed header names the transport (stateblock.protocol.locator): the bus (rows inline
in the message, or a payload object fetched from the store) or a slot of this process's
slot pool (the local data plane: the rows on the capture's device, never copied to bytes).
Whichever it is, the header is verified (signature, expiry, layout, model identity, this
worker's limits) before the block is claimed; the rows' digest is checked beside the claim
(`confirm()` of what `verify` returns), for a slot on the rows' own device.
"""

from __future__ import annotations

import asyncio

import nats
import nats.js.errors as js_errors
import structlog
import torch
from nats.js.object_store import ObjectStore
from torch import Tensor

from stateblock.engines import ReadoutEngine
from stateblock.model.arena import ARENAS, ArenaUnreachable, copy_out
from stateblock.model.rows import check_rows
from stateblock.model.shm import open_region, region_name, unlink_region
from stateblock.model.slots import SlotPool, SlotVerified
from stateblock.protocol import envelope, locator, streams
from stateblock.protocol.envelope import BlockRejected, HeaderVerified, RejectReason
from stateblock.protocol.keys import TrustStore
from stateblock.protocol.layouts import LayoutError
from stateblock.protocol.sampling import Limits
from stateblock.v1 import block_pb2 as block_pb

log = structlog.get_logger("readout_svc")
# Reasons beyond the envelope's, for blocks whose signed header verified:
MODEL_MISMATCH = "model_mismatch"  # valid, but for another model's pieces
OBJECT_MISSING = "object_missing"  # its rows' object is gone from the store
ROWS_MISSING = str(RejectReason.ROWS_MISSING)  # its slot or region lost the rows
LIMITS = "limits"  # asks for more than this worker reads (lanes, depth, rows)


class Rejected(Exception):
    """A block this worker will not read. `authentic` as in envelope.BlockRejected: only a
    failure of the signed block itself may end the request it names."""

    def __init__(self, reason: str, detail: str, *, authentic: bool = True) -> None:
        self.reason = reason
        self.detail = detail
        self.authentic = authentic
        super().__init__(f"{reason}: {detail}")


# releases in flight (a task the loop holds only weakly would be collected unsent)
_RELEASING: set[asyncio.Task] = set()


def free_slot(
    slots: SlotPool | None, header: block_pb.StateBlockHeader, nc: nats.NATS | None = None
) -> None:
    """Give back the slot of a block that has its outcome, if the block still holds it
    (a host region is the block's alone: unlinked; a span of an arena: freed in the
    capture's process, released to it from another, through `nc`)."""
    kind = locator.transport(header)
    if kind == block_pb.TRANSPORT_LOCAL and slots is not None:
        slots.free(header.locator.slot, header.block_id)
    elif kind == block_pb.TRANSPORT_HOST and header.locator.region == region_name(header.block_id):
        unlink_region(header.locator.region)
    elif kind == block_pb.TRANSPORT_CUDA_IPC:
        ipc = header.locator.cuda_ipc
        arena = ARENAS.get(ipc.pool)
        if arena is not None:
            arena.free(ipc.rows_offset_bytes, header.block_id)
        elif nc is not None and not nc.is_closed:
            subject = streams.release_subject(ipc.pool)
            data = streams.release_message(header.block_id, ipc.rows_offset_bytes)
            task = asyncio.get_running_loop().create_task(nc.publish(subject, data))
            _RELEASING.add(task)
            task.add_done_callback(_RELEASING.discard)


class BlockRows:
    """One process's way to its blocks' rows: the payload store and, on the local data
    plane, the slot pool it shares with the capture."""

    def __init__(
        self,
        engine: ReadoutEngine,
        trust: TrustStore,
        limits: Limits,
        *,
        nc: nats.NATS,
        objects: ObjectStore,
        object_timeout_s: float,
        slots: SlotPool | None = None,
        host: str | None = None,  # the placement of this host's rows (`host`, `ipc` planes)
    ) -> None:
        self._engine, self._trust, self._limits = engine, trust, limits
        self._host = host
        self._nc, self._objects, self._object_timeout = nc, objects, object_timeout_s
        self._slots = slots

    async def verify(
        self, block: block_pb.StateBlock, inline_rows: memoryview | None
    ) -> HeaderVerified | SlotVerified:
        """Everything but the rows' digest; raises Rejected or BlockRejected."""
        if block.HasField("header") and locator.on_host(block.header):
            checked: HeaderVerified | SlotVerified = self._in_slot(block)
        elif block.payload.WhichOneof("location") == "object_ref":
            try:  # signature, expiry and layout first: an untrusted block fetches nothing
                envelope.verify_header(block, self._trust)
            except ValueError:  # only the payload is missing: fetch it
                pass
            checked = envelope.verify_header(block, self._trust, payload=await self._fetch(block))
        else:
            checked = envelope.verify_header(block, self._trust, payload=inline_rows)
        header, want = checked.header, self._engine.identity
        if (
            header.model != want.model
            or header.base_model_digest != want.base_model_digest
            or header.lm_head_digest != want.lm_head_digest
            or header.decoder_digest != want.decoder_digest
        ):
            raise Rejected(MODEL_MISMATCH, f"block for {header.model!r} / other model pieces")
        self._check_limits(header)
        return checked

    def free(self, header: block_pb.StateBlockHeader) -> None:
        """The block has its outcome: its slot, if it still holds one, goes back."""
        free_slot(self._slots, header, self._nc)

    def _in_slot(self, block: block_pb.StateBlock) -> SlotVerified:
        header = envelope.trusted_header(block, self._trust, rows_apart=True)
        where = header.locator
        if where.transport == block_pb.TRANSPORT_HOST:
            return SlotVerified(header, self._in_region(header))
        if where.transport == block_pb.TRANSPORT_CUDA_IPC:
            return SlotVerified(header, *self._in_arena(header))
        if self._slots is None or where.placement != self._slots.instance_id:
            raise Rejected(ROWS_MISSING, f"pool {where.placement!r} is not this process's")
        held = self._slots.rows(where.slot)
        if held is None:
            raise Rejected(ROWS_MISSING, f"slot {where.slot} is free: the rows are gone")
        try:  # a reused slot may hold another block's rows: the checksum says, or the shape
            check_rows(held[1], header.layout)
        except LayoutError as e:
            detail = f"slot {where.slot} holds other rows: {e}"
            raise BlockRejected(RejectReason.ROWS_MISSING, detail, authentic=True) from e
        return SlotVerified(header, held[1])

    def _in_region(self, header: block_pb.StateBlockHeader) -> Tensor:
        where = header.locator
        if where.placement != self._host:
            raise Rejected(ROWS_MISSING, f"placement {where.placement!r} is not this host's")
        if where.region != region_name(header.block_id):
            raise Rejected(ROWS_MISSING, f"region {where.region!r} is not the block's")
        try:
            rows = open_region(where.region, header.layout)
        except ValueError as e:  # written over with other rows, or cut short
            raise BlockRejected(RejectReason.ROWS_MISSING, str(e), authentic=True) from e
        if rows is None:
            raise Rejected(ROWS_MISSING, f"region {where.region} is gone: the rows are gone")
        return rows

    def _in_arena(
        self, header: block_pb.StateBlockHeader
    ) -> tuple[Tensor, torch.cuda.Event | None]:
        """The rows copied out of the capture's arena, and the event of that copy (on a
        GPU): the checksum is then checked over the copy, which no later use of the span can
        change, as soon as the copy is in."""
        where = header.locator
        if where.placement != self._host:
            raise Rejected(ROWS_MISSING, f"placement {where.placement!r} is not this host's")
        try:
            return copy_out(where.cuda_ipc, header.layout)
        except ArenaUnreachable as e:
            raise Rejected(ROWS_MISSING, str(e)) from e
        except ValueError as e:  # a span the arena does not hold
            raise BlockRejected(RejectReason.ROWS_MISSING, str(e), authentic=True) from e

    def _check_limits(self, header: block_pb.StateBlockHeader) -> None:
        """Signed sizes are still requests: refuse what this worker would not serve before
        allocating anything for it."""
        lim, lanes = self._limits, header.layout.lanes
        if len(lanes) > lim.max_lanes:
            raise Rejected(LIMITS, f"{len(lanes)} lanes, over {lim.max_lanes}")
        for lane in lanes:
            if lane.answer_depth > lim.answer_depth_max:
                raise Rejected(LIMITS, f"depth {lane.answer_depth} over {lim.answer_depth_max}")
            if lane.row_count > lim.prompt_len_max:
                raise Rejected(LIMITS, f"{lane.row_count} rows over {lim.prompt_len_max}")

    async def _fetch(self, block: block_pb.StateBlock) -> bytes:
        ref = block.payload.object_ref
        if ref.bucket != streams.PAYLOAD_BUCKET:
            raise Rejected(OBJECT_MISSING, f"unknown bucket {ref.bucket!r}")
        try:
            # bounded: nats-py's get waits for the chunks with no deadline, and an object
            # whose chunks go while it is read (deleted, aged out) would hold this worker
            # and its pull loop forever
            data = await asyncio.wait_for(
                streams.read_payload(self._objects, ref.name), self._object_timeout
            )
        except TimeoutError as e:
            if await streams.payload_gone(self._nc.jetstream(), self._objects, ref.name):
                raise Rejected(OBJECT_MISSING, f"object {ref.name!r} gone while read") from e
            raise  # a slow store: no ack, the block comes back after ack_wait
        except js_errors.DigestMismatchError as e:
            raise Rejected(
                str(RejectReason.FORWARD_STATE_DIGEST), "object chunks", authentic=False
            ) from e
        except js_errors.NotFoundError as e:
            raise Rejected(OBJECT_MISSING, f"object {ref.name!r} not found") from e
        return data

    async def cleanup(self, block: block_pb.StateBlock) -> None:
        """A committed block's payload object, deleted (the bucket's TTL would age it out)."""
        if block.payload.WhichOneof("location") != "object_ref":
            return
        try:
            await self._objects.delete(block.payload.object_ref.name)
        except (TimeoutError, nats.errors.Error) as e:  # the bucket TTL ages it out anyway
            log.warning("payload object not deleted", error=repr(e))
