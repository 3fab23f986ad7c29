"""Rows in a device arena shared through CUDA IPC: the `ipc` data plane (a capture process and
readout processes on one host, on the capture's GPU or a peer of it).

The capture allocates one buffer on its device at start-up (`DeviceArena`,
`STATEBLOCK_DATA_PLANE_ARENA_MB`) and shares it once (`share`: PyTorch's reduction of a CUDA
storage, what torch.multiprocessing sends, made a `CudaIpcRows` of the header's locator). A
block's rows are copied into a span of it (the forward's own tensor is then free for the
next forward), the device synchronised, and the header signed with the span's offset and the
rows' slot checksum. A reader opens the arena once (`open_arena`, cached for the process's
life), copies the block's span out to its own device and checks the checksum over the copy:
a span reused or written over meanwhile fails it, so what is read is what was signed. Once
the block has its outcome the reader publishes its id on the arena's release subject and the
capture frees the span; a span whose release never comes is freed at its block's expiry.

A reader in the capture's own process (CUDA cannot open an allocation's handle in the process
that made it) finds the arena in this module's registry instead; so does a CPU arena, which
is never shared and serves the tests of everything but the handle.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from stateblock.model.rows import rows_stream, torch_dtype
from stateblock.model.slots import Waiting, seconds_to_next
from stateblock.v1 import block_pb2 as pb

ALIGN = 512  # bytes: every span starts on it (any dtype's alignment, and then some)
# this process's arenas by pool id: what a reader in the capture's own process reads
ARENAS: dict[str, DeviceArena] = {}
# arenas of other processes this process has opened, by (pool id, handle), the most recently
# used last: each opened once, and the least recently used let go past OPEN_MAX (a capture
# that restarted has a new arena; its old one's memory lives while a process maps it)
_OPENED: OrderedDict[tuple[str, bytes], Tensor] = OrderedDict()
OPEN_MAX = 16


def ipc_placement() -> str:
    """This host's placement for CUDA IPC rows: its boot, which every process of the host
    computes alike (a reader must also see the capture's GPU: `open_arena` says so)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else "no-boot-id"
    return "ipc-" + hashlib.sha256(boot_id.encode()).hexdigest()[:16]


def rows_nbytes(layout: pb.Layout) -> int:
    return layout.total_rows * layout.hidden_size * torch_dtype(layout.dtype).itemsize


@dataclass
class _Span:
    block_id: str
    nbytes: int
    expires_at: float  # unix seconds: the block's own expiry


class DeviceArena:
    """`nbytes` of device memory holding at most `slots` blocks' rows at once, on one event
    loop. `instance_id` names the arena in headers and in its release subject."""

    def __init__(
        self,
        nbytes: int,
        *,
        device: torch.device | str,
        slots: int,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if slots < 1 or nbytes < ALIGN:
            raise ValueError("an arena needs at least one slot and one aligned span")
        self.instance_id = instance_id or uuid.uuid4().hex
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)  # (nbytes,)
        self._slots, self._clock = slots, clock
        self._spans: dict[int, _Span] = {}  # offset -> span
        self._waiting = Waiting()
        ARENAS[self.instance_id] = self

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def close(self) -> None:
        ARENAS.pop(self.instance_id, None)

    def held(self) -> int:
        """Spans holding a block (expired ones freed first)."""
        self.reap()
        return len(self._spans)

    async def reserve(self, block_id: str, nbytes: int, expires_at: float, timeout_s: float) -> int:
        """The offset of a span of `nbytes` for `block_id`, waiting up to `timeout_s` for
        room (then SlotPoolFull); ValueError for rows larger than the arena."""
        if nbytes > self.nbytes:
            raise ValueError(
                f"{nbytes} bytes of rows do not fit the {self.nbytes}-byte arena "
                "(STATEBLOCK_DATA_PLANE_ARENA_MB)"
            )

        def take() -> int | None:
            self.reap()
            offset = self._fit(nbytes)
            if offset is None or len(self._spans) >= self._slots:
                return None
            self._spans[offset] = _Span(block_id, nbytes, expires_at)
            return offset

        def full() -> str:
            return (
                f"the {self.nbytes}-byte arena has no room for {nbytes} bytes "
                f"({len(self._spans)} blocks not yet read) after {timeout_s:g} s"
            )

        return await self._waiting.until(take, self._next_expiry, timeout_s, full)

    def _fit(self, nbytes: int) -> int | None:
        """The first aligned gap of `nbytes` between the spans held (first fit)."""
        start = 0
        for offset in sorted(self._spans):
            if offset - start >= nbytes:
                return start
            start = _aligned(offset + self._spans[offset].nbytes)
        return start if self.nbytes - start >= nbytes else None

    def fill(self, offset: int, block_id: str, rows: Tensor) -> None:
        """Copy the rows of the block that reserved the span at `offset` into it, and wait
        for the copy: a reader in another process sees the header only after this."""
        span = self._spans.get(offset)
        if span is None or span.block_id != block_id:
            raise KeyError(f"span {offset} is not reserved for block {block_id}")
        data = rows.detach().contiguous().view(-1).view(torch.uint8)
        if data.numel() != span.nbytes:
            raise ValueError(f"{data.numel()} bytes of rows for a span of {span.nbytes}")
        if self.buffer.device.type != "cuda":
            self.buffer[offset : offset + span.nbytes].copy_(data)
            return
        side = rows_stream(self.buffer.device)  # ahead of queued forwards, not behind them
        side.wait_stream(torch.cuda.current_stream(self.buffer.device))  # the rows' writer
        with torch.cuda.stream(side):
            self.buffer[offset : offset + span.nbytes].copy_(data)
        side.synchronize()

    def free(self, offset: int, block_id: str) -> bool:
        """Give the span back if `block_id` holds it; False otherwise (freed already,
        expired, or reused by another block, whose span this call leaves alone)."""
        span = self._spans.get(offset)
        if span is None or span.block_id != block_id:
            return False
        del self._spans[offset]
        self._waiting.wake()
        return True

    def reap(self) -> int:
        """Free the spans of expired blocks (a block past its expiry is rejected unread)."""
        now = self._clock()
        expired = [o for o, s in self._spans.items() if s.expires_at <= now]
        for offset in expired:
            del self._spans[offset]
        if expired:
            self._waiting.wake()
        return len(expired)

    def _next_expiry(self) -> float:
        return seconds_to_next((s.expires_at for s in self._spans.values()), self._clock())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def device_uuid(device: torch.device) -> str:
    """The CUDA UUID of `device` (the same in every process, where its number is not)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(arena: DeviceArena) -> pb.CudaIpcRows:
    """The locator part every block of the arena carries: the pool, and on a GPU its shared
    allocation (taken once: one reference for the readers, who open it once each)."""
    out = pb.CudaIpcRows(pool=arena.instance_id)
    if arena.buffer.device.type != "cuda":
        return out  # read in this process only (the registry)
    storage = arena.buffer.untyped_storage()
    (_, handle, size, offset, ref_handle, ref_offset, event, sync) = storage._share_cuda_()
    out.device_uuid = device_uuid(arena.buffer.device)
    out.mem_handle, out.storage_bytes, out.storage_offset_bytes = handle, size, offset
    out.ref_counter_handle, out.ref_counter_offset = ref_handle, ref_offset
    out.event_handle, out.event_sync_required = event or b"", bool(sync)
    return out


class ArenaUnreachable(Exception):
    """The block's arena is neither in this process nor one it can open."""


def open_arena(ipc: pb.CudaIpcRows) -> Tensor:
    """The arena's buffer (nbytes,) uint8: this process's own, or another process's opened
    through its handle on the GPU of that UUID (once; cached for the process's life).
    Raises ArenaUnreachable with the reason."""
    local = ARENAS.get(ipc.pool)
    if local is not None:
        return local.buffer
    if not ipc.mem_handle:
        raise ArenaUnreachable(f"arena {ipc.pool} is another process's and not shared")
    key = (ipc.pool, ipc.mem_handle)
    if key in _OPENED:
        _OPENED.move_to_end(key)
        return _OPENED[key]
    index = _device_of(ipc.device_uuid)
    try:  # a capture that exited (its allocation gone), or peers without access
        storage = torch.UntypedStorage._new_shared_cuda(
            index, ipc.mem_handle, ipc.storage_bytes, ipc.storage_offset_bytes,
            ipc.ref_counter_handle, ipc.ref_counter_offset,
            ipc.event_handle, ipc.event_sync_required,
        )  # fmt: skip
    except RuntimeError as e:
        raise ArenaUnreachable(f"arena {ipc.pool} on GPU {ipc.device_uuid}: {e}") from e
    buffer = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    buffer.set_(storage, 0, (ipc.storage_bytes,))
    _OPENED[key] = buffer
    if len(_OPENED) > OPEN_MAX:
        torch.cuda.synchronize()  # no copy out of the one let go is still in flight
        _OPENED.popitem(last=False)
    return buffer


def _device_of(uuid_: str) -> int:
    if not torch.cuda.is_available():
        raise ArenaUnreachable(f"the rows are on GPU {uuid_} and this process has no CUDA")
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid_:
            return index
    raise ArenaUnreachable(f"GPU {uuid_} holding the rows is not visible to this process")


def copy_rows(
    ipc: pb.CudaIpcRows, layout: pb.Layout, device: torch.device | str | None = None
) -> Tensor:
    """The block's rows (total_rows, hidden_size), copied out of its arena (onto `device`;
    None: the arena's own):
    the copy is what the checksum is checked over and the readout reads, whatever becomes
    of the span. Raises ArenaUnreachable, or ValueError for a span outside the arena."""
    return copy_out(ipc, layout, device)[0]


def copy_out(
    ipc: pb.CudaIpcRows, layout: pb.Layout, device: torch.device | str | None = None
) -> tuple[Tensor, torch.cuda.Event | None]:
    """copy_rows, and on a GPU the event its copy recorded: the copy runs on the rows stream
    (the capture wrote the span before its header went out, so it waits for nothing here),
    the caller's stream waits for it on the device, and a checksum after the event waits for
    nothing else the caller has queued."""
    buffer = open_arena(ipc)
    start, nbytes = ipc.rows_offset_bytes, rows_nbytes(layout)
    if start % ALIGN or start + nbytes > buffer.numel():
        raise ValueError(f"span {start}+{nbytes} is outside the {buffer.numel()}-byte arena")
    span, ready = buffer[start : start + nbytes], None
    target = buffer.device if device is None else torch.device(device)
    if target.type == "cuda" and buffer.device.type == "cuda":
        side, caller = rows_stream(target), torch.cuda.current_stream(target)
        with torch.cuda.stream(side):
            span = span.to(target, copy=True)  # (nbytes,)
        ready = torch.cuda.Event()
        ready.record(side)
        caller.wait_event(ready)
        span.record_stream(caller)  # made on the rows stream, read on the caller's
    else:
        span = span.clone() if device is None else span.to(device, copy=True)
    rows = span.view(torch_dtype(layout.dtype)).view(layout.total_rows, layout.hidden_size)
    return rows, ready
