"""How a capture's rows leave it: sealed into the block on the bus, or held on this host.

`BusPlane` digests the rows' bytes, signs the header and publishes the block with its rows
(inline, or through the object store over max_payload). `LocalPlane` keeps the rows where
the forward left them, in a slot of the process's slot pool (stateblock.model.slots): it
reserves a slot (waiting while every slot is held), digests the rows where they are (the
slot checksum on an accelerator, the configured hash in host memory), signs a header whose locator names the pool and the slot, and publishes the header alone
on the pool's placement subject. `HostPlane` does the same with a shared-memory region of
this host (stateblock.model.shm) for readout processes beside the capture's, and `IpcPlane`
with a span of the capture's device arena, shared through CUDA IPC (stateblock.model.arena):
the rows never leave the GPU. A capture
that fails after its reservation gives the slot back: nothing of it stays behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram
from torch import Tensor

from capture_svc.config import CaptureConfig
from capture_svc.publisher import BlockPublisher
from stateblock.model.arena import DeviceArena, ipc_placement, rows_nbytes, share
from stateblock.model.rows import HOST_CHUNK_BYTES, host_chunks, rows_view
from stateblock.model.shm import HostRegions
from stateblock.model.slots import SlotPool, rows_digest, slot_algorithm
from stateblock.protocol import envelope, layouts, locator
from stateblock.protocol.envelope import ModelIdentity
from stateblock.protocol.ids import uuid7
from stateblock.protocol.keys import Signer
from stateblock.v1 import block_pb2 as pb


@dataclass(frozen=True)
class Delivered:
    block_id: str
    via_object_store: bool


@dataclass(frozen=True)
class Sealer:
    """What every plane signs with: the capture's key, its model's identity, the ttl, and
    the hash of rows' bytes (STATEBLOCK_FORWARD_STATE_DIGEST)."""

    signer: Signer
    identity: ModelIdentity
    ttl_s: float
    algorithm: int = pb.DIGEST_ALGORITHM_BLAKE3


@dataclass(frozen=True)
class Placed:
    """Where a block's rows went: their digest under `algorithm`, the locator that names
    them (None: they travel in the block), and their bytes when they do."""

    digest: bytes
    algorithm: int
    locator: pb.RowsLocator | None = None
    data: memoryview | None = None
    spans: dict[str, float] = field(default_factory=dict)  # stage -> seconds, within sign


class DataPlane:
    """How a block's rows travel; its signed header always goes over JetStream. `deliver`
    finds the rows a place (`store`: a SlotPool or HostRegions, for the planes that keep
    them), puts them there, signs the header and publishes; a failure before the publish
    gives their place back, so nothing of the capture stays behind."""

    def __init__(
        self, publisher: BlockPublisher, sealer: Sealer, store: Any = None, *, wait_s: float = 0
    ) -> None:
        self._publisher, self._sealer, self._wait_s = publisher, sealer, wait_s
        self._store = store

    async def _reserve(self, block_id: str, expires_at: float, layout: pb.Layout) -> Any:
        """A place for the block's rows, waiting up to wait_s for one (then SlotPoolFull)."""
        return await self._store.reserve(block_id, expires_at, self._wait_s)

    async def _place(self, held: Any, block_id: str, layout: pb.Layout, rows: Tensor) -> Placed:
        raise NotImplementedError

    def _give_back(self, held: Any, block_id: str) -> None:
        raise NotImplementedError

    async def _publish(self, header: pb.StateBlockHeader, placed: Placed) -> bool:
        """Publish; True if the rows went through the object store."""
        await self._publisher.publish_header(header)
        return False

    async def deliver(
        self,
        layout: pb.Layout,
        rows: Tensor,
        *,
        request_id: str,
        sampling: Sequence[pb.SamplingParams],
        stage: Histogram,
    ) -> Delivered:
        """Sign and publish the block of `rows`; raises PublishError or SlotPoolFull."""
        s = self._sealer
        block_id, now = uuid7(), time.time()
        t_wait = time.perf_counter()
        try:  # a full store waits, up to its bound
            held = await self._reserve(block_id, now + s.ttl_s, layout)
        finally:
            stage.labels("reserve").observe(time.perf_counter() - t_wait)
        try:
            t0 = time.perf_counter()
            placed = await self._place(held, block_id, layout, rows)
            header = envelope.signed_header(
                layout, placed.digest, placed.algorithm, request_id=request_id,
                identity=s.identity, sampling=sampling, signer=s.signer, ttl_s=s.ttl_s,
                block_id=block_id, now=now, locator=placed.locator,
            )  # fmt: skip
            t1 = time.perf_counter()
            stage.labels("sign").observe(t1 - t0)
            for name, seconds in placed.spans.items():
                stage.labels(name).observe(seconds)
            via_object = await self._publish(header, placed)
            stage.labels("publish").observe(time.perf_counter() - t1)
        except BaseException:
            self._give_back(held, block_id)  # no block goes out
            raise
        return Delivered(block_id, via_object)


class BusPlane(DataPlane):
    """The rows in the block: inline, or through the object store over max_payload."""

    async def _reserve(self, block_id: str, expires_at: float, layout: pb.Layout) -> None:
        return None

    async def _place(self, held: None, block_id: str, layout: pb.Layout, rows: Tensor) -> Placed:
        data = memoryview(rows_view(rows)).cast("B")  # a GPU's rows copied to the host once
        layouts.check_payload_size(data, layout)
        algorithm = self._sealer.algorithm
        return Placed(envelope.forward_state_digest(data, algorithm), algorithm, data=data)

    def _give_back(self, held: None, block_id: str) -> None:
        pass

    async def _publish(self, header: pb.StateBlockHeader, placed: Placed) -> bool:
        assert placed.data is not None
        return await self._publisher.publish(envelope.SealedBlock(header, placed.data))


class LocalPlane(DataPlane):
    """Rows in a slot of this process's pool (`store`: a SlotPool), on the capture's
    device."""

    async def _place(self, held: int, block_id: str, layout: pb.Layout, rows: Tensor) -> Placed:
        # where the rows are, off the event loop (a GPU synchronises for 32 bytes)
        algorithm = slot_algorithm(rows, self._sealer.algorithm)
        digest = await asyncio.to_thread(rows_digest, rows, algorithm)
        self._store.fill(held, block_id, rows)
        return Placed(
            digest, algorithm, locator.slot_locator(locator.LOCAL, self._store.instance_id, held)
        )

    def _give_back(self, held: int, block_id: str) -> None:
        self._store.free(held, block_id)


class HostPlane(DataPlane):
    """Rows in a shared-memory region of this host (`store`: stateblock.model.shm's
    HostRegions), for readout processes beside the capture's."""

    async def _place(self, held: str, block_id: str, layout: pb.Layout, rows: Tensor) -> Placed:
        algorithm = self._sealer.algorithm
        spans: dict[str, float] = {}
        digest = await asyncio.to_thread(self._write, held, rows, algorithm, spans)
        where = locator.slot_locator(locator.HOST, self._store.placement, 0, held)
        return Placed(digest, algorithm, where, spans=spans)

    def _write(self, held: str, rows: Tensor, algorithm: int, spans: dict[str, float]) -> bytes:
        """The rows' bytes hashed and written into their region piece by piece (a GPU's
        copied to the host in pieces, a CPU's one piece), in one trip off the event loop;
        returns their digest and adds each part's seconds to `spans` (rows_copy,
        rows_digest, rows_write)."""
        nbytes = rows.numel() * rows.element_size()
        hasher = envelope.forward_state_hasher(algorithm, nbytes)
        totals = dict.fromkeys(("rows_copy", "rows_digest", "rows_write"), 0.0)
        # rows already in host memory go whole: in pieces 176 MB took 86 ms against 77 (2 cores)
        size = HOST_CHUNK_BYTES if rows.device.type == "cuda" else max(1, nbytes)

        def hashed() -> Iterator[memoryview]:
            pieces = host_chunks(rows, size)
            while True:
                t0 = time.perf_counter()
                piece = next(pieces, None)
                t1 = time.perf_counter()
                totals["rows_copy"] += t1 - t0
                if piece is None:
                    return
                hasher.update(piece)
                totals["rows_digest"] += time.perf_counter() - t1
                yield piece

        t_all = time.perf_counter()
        self._store.write_chunks(held, hashed())
        totals["rows_write"] = time.perf_counter() - t_all - totals["rows_copy"]
        totals["rows_write"] -= totals["rows_digest"]
        spans.update(totals)
        return hasher.digest()

    def _give_back(self, held: str, block_id: str) -> None:
        self._store.release(held)


class IpcPlane(DataPlane):
    """Rows in a span of the capture's device arena (`store`: stateblock.model.arena's
    DeviceArena), shared through CUDA IPC with the readout processes of this host."""

    def __init__(
        self, publisher: BlockPublisher, sealer: Sealer, store: DeviceArena, *, wait_s: float
    ) -> None:
        super().__init__(publisher, sealer, store, wait_s=wait_s)
        self._shared = share(store)  # once: every block's locator names the same arena
        self._placement = ipc_placement()

    async def _reserve(self, block_id: str, expires_at: float, layout: pb.Layout) -> int:
        nbytes = rows_nbytes(layout)
        return await self._store.reserve(block_id, nbytes, expires_at, self._wait_s)

    async def _place(self, held: int, block_id: str, layout: pb.Layout, rows: Tensor) -> Placed:
        # the copy into the span, and its checksum there, off the event loop (the device
        # synchronises before the header can go out)
        algorithm = slot_algorithm(self._store.buffer, self._sealer.algorithm)
        digest = await asyncio.to_thread(self._fill, held, block_id, rows, algorithm)
        return Placed(digest, algorithm, locator.ipc_locator(self._placement, self._shared, held))

    def _fill(self, held: int, block_id: str, rows: Tensor, algorithm: int) -> bytes:
        self._store.fill(held, block_id, rows)
        return rows_digest(rows, algorithm)

    def _give_back(self, held: int, block_id: str) -> None:
        self._store.free(held, block_id)


def data_plane(
    config: CaptureConfig,
    publisher: BlockPublisher,
    sealer: Sealer,
    slots: SlotPool | HostRegions | DeviceArena | None,
) -> DataPlane:
    """The plane the config names, with the slots it keeps rows in (`local`: the process's
    slot pool; `host`: its shared-memory regions; `ipc`: its device arena)."""
    if config.data_plane == locator.BUS:
        return BusPlane(publisher, sealer)
    wait_s = config.publish_timeout_s
    if isinstance(slots, SlotPool) and config.data_plane == locator.LOCAL:
        return LocalPlane(publisher, sealer, slots, wait_s=wait_s)
    if isinstance(slots, HostRegions) and config.data_plane == locator.HOST:
        return HostPlane(publisher, sealer, slots, wait_s=wait_s)
    if isinstance(slots, DeviceArena) and config.data_plane == locator.CUDA_IPC:
        return IpcPlane(publisher, sealer, slots, wait_s=wait_s)
    raise ValueError(f"data plane {config.data_plane!r} without its slots")
