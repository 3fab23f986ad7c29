"""The slot pool: captured rows that stay where they were captured, and their checksum.

With `STATEBLOCK_DATA_PLANE=local` the capture and the readout workers share a process: a
block's rows stay on the capture's device, held in one of a fixed number of slots, and its
signed header (over JetStream) names the pool and the slot (stateblock.protocol.locator).
A slot is held from the capture's reservation until the block's commit or rejection, or its
expiry, whichever comes first: a worker that dies holding a block leaves the slot to the
block's redelivery, and an expired block's slot goes back to the pool at the next reservation.

A slot holds a reference to the rows, never a buffer that is written over: a reader that
took the rows keeps them whatever becomes of the slot. A slot is freed only by the block
that holds it (`free(slot, block_id)`), so a stale delivery cannot free another block's
slot, and the rows a stale delivery finds in a reused slot fail the signed digest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from stateblock.model.kernels import checksum
from stateblock.model.rows import rows_stream, rows_view
from stateblock.protocol import envelope
from stateblock.v1 import block_pb2 as pb

# The checksum's four lanes: rows' 16-bit words w_i (as unsigned) and positions i,
# sum_i (w_i + 1) * ((i * A + B) mod P) for each (A, B, P). Every product stays under 2**63
# for blocks of up to 2**28 words, so the integer sums are exact in any order: the same
# bytes on any device, reduced in any order, give the same checksum.
_LANES = (
    (1_000_003, 7, 2_147_483_647),
    (69_069, 12_345, 2_147_483_629),
    (2_654_435, 97, 2_147_483_587),
    (40_503, 1, 2_147_483_579),
)
MAX_WORDS = 1 << 28


def rows_checksum(rows: Tensor, ready: torch.cuda.Event | None = None) -> bytes:
    """DIGEST_ALGORITHM_SLOT_CHECKSUM of the rows, computed on their device: 32 bytes, four
    64-bit sums; only those come back to the host. Not cryptographic (block.proto says
    where it is accepted and why).

    On a GPU it runs on the rows stream (`rows_stream`) in one kernel where Triton is
    installed, after `ready` (the event that the rows' copy recorded) or, without one, after
    the work already queued on the caller's stream."""
    words = rows.detach().contiguous().view(-1).view(torch.int16)
    if words.numel() > MAX_WORDS:
        raise ValueError(f"{words.numel()} words: over the checksum's {MAX_WORDS}")
    if words.device.type != "cuda":
        return _checksum_sums(words).numpy().astype("<i8").tobytes()
    side = rows_stream(words.device)
    if ready is None:
        side.wait_stream(torch.cuda.current_stream(words.device))
    else:
        side.wait_event(ready)
    with torch.cuda.stream(side):
        if checksum.available(words.device):
            sums = checksum.checksum_sums(words, _LANES)
        else:
            sums = _checksum_sums(words)
        return sums.cpu().numpy().astype("<i8").tobytes()  # waits for the rows stream alone


def _checksum_sums(words: Tensor) -> Tensor:
    """The four sums in PyTorch: the reference the kernel is tested against."""
    words = (words.to(torch.int64) & 0xFFFF) + 1
    index = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    return torch.stack([(words * ((index * a + b) % p)).sum() for a, b, p in _LANES])


def slot_algorithm(rows: Tensor, host_algorithm: int) -> int:
    """The digest of rows kept where they are: the slot checksum on an accelerator (no copy
    to the host just to hash), `host_algorithm` (a hash, BLAKE3 by default: ~100x faster than
    the checksum's integer passes on a CPU core) for rows in host memory."""
    return pb.DIGEST_ALGORITHM_SLOT_CHECKSUM if rows.device.type != "cpu" else host_algorithm


def rows_digest(rows: Tensor, algorithm: int, ready: torch.cuda.Event | None = None) -> bytes:
    """The forward-state digest of rows kept where they are, under `algorithm` (`ready`:
    rows_checksum's)."""
    if algorithm == pb.DIGEST_ALGORITHM_SLOT_CHECKSUM:
        return rows_checksum(rows, ready)
    return envelope.forward_state_digest(rows_view(rows), algorithm)


T = TypeVar("T")


class SlotPoolFull(Exception):
    """No slot came free within the wait: every slot holds a block not yet read."""


def seconds_to_next(expiries, now: float) -> float:
    """Seconds until the first of `expiries` (unix seconds) has passed (inf: none)."""
    pending = list(expiries)
    return max(0.0, min(pending) - now) + 0.001 if pending else float("inf")


class Waiting:
    """A pool's reservations waiting for room, on one event loop: each retried when the pool
    frees something (`wake`), at its next expiry, and given up at its deadline."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def until(
        self,
        take: Callable[[], T | None],
        next_expiry: Callable[[], float],
        timeout_s: float,
        full: Callable[[], str],
    ) -> T:
        """What `take` returns once it is not None (SlotPoolFull, saying `full()`, after
        `timeout_s`); `next_expiry()`: seconds until the pool's next block expires."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            got = take()
            if got is not None:
                return got
            left = deadline - loop.time()
            if left <= 0:
                raise SlotPoolFull(full())
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, min(left, next_expiry()))
            except TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class _Held:
    block_id: str
    expires_at: float  # unix seconds: the block's own expiry
    rows: Tensor | None = None  # None between the reservation and `fill`


class SlotPool:
    """`slots` slots of captured rows, on one event loop (the capture and the readout of one
    process). `instance_id` names the pool in block headers and subjects."""

    def __init__(
        self,
        slots: int,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if slots < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.instance_id = instance_id or uuid.uuid4().hex
        self._held: list[_Held | None] = [None] * slots
        self._clock = clock
        self._waiting = Waiting()

    @property
    def size(self) -> int:
        return len(self._held)

    def held(self) -> int:
        """Slots holding a block (expired ones freed first)."""
        self.reap()
        return sum(entry is not None for entry in self._held)

    async def reserve(self, block_id: str, expires_at: float, timeout_s: float) -> int:
        """A free slot for `block_id`, waiting up to `timeout_s` for one to come free;
        raises SlotPoolFull after that."""

        def take() -> int | None:
            self.reap()
            for index, entry in enumerate(self._held):
                if entry is None:
                    self._held[index] = _Held(block_id, expires_at)
                    return index
            return None

        def full() -> str:
            return f"all {self.size} slots hold blocks not yet read after {timeout_s:g} s"

        return await self._waiting.until(take, self._next_expiry, timeout_s, full)

    def fill(self, slot: int, block_id: str, rows: Tensor) -> None:
        """The rows of the block that reserved `slot`."""
        entry = self._held[slot]
        if entry is None or entry.block_id != block_id:
            raise KeyError(f"slot {slot} is not reserved for block {block_id}")
        entry.rows = rows

    def rows(self, slot: int) -> tuple[str, Tensor] | None:
        """(the holding block's id, its rows), or None for a free or unfilled slot."""
        entry = self._held[slot] if 0 <= slot < len(self._held) else None
        if entry is None or entry.rows is None:
            return None
        return entry.block_id, entry.rows

    def free(self, slot: int, block_id: str) -> bool:
        """Give `slot` back if `block_id` holds it; False otherwise (freed already, expired,
        or reused by another block, whose slot this call leaves alone)."""
        entry = self._held[slot] if 0 <= slot < len(self._held) else None
        if entry is None or entry.block_id != block_id:
            return False
        self._held[slot] = None
        self._waiting.wake()
        return True

    def reap(self) -> int:
        """Free the slots of expired blocks (a block past its expiry is rejected unread)."""
        now, freed = self._clock(), 0
        for index, entry in enumerate(self._held):
            if entry is not None and entry.expires_at <= now:
                self._held[index] = None
                freed += 1
        if freed:
            self._waiting.wake()
        return freed

    def _next_expiry(self) -> float:
        return seconds_to_next((e.expires_at for e in self._held if e is not None), self._clock())


@dataclass(frozen=True)
class SlotVerified:
    """A block whose signed header verified and whose slot holds rows of its layout's shape,
    not yet matched against its checksum (`confirm`, on the rows' device): what
    envelope.HeaderVerified is for bytes."""

    header: pb.StateBlockHeader
    rows: Tensor  # (total_rows, hidden_size), where the capture left them
    ready: torch.cuda.Event | None = None  # rows copied on the rows stream: when they are in

    def confirm(self) -> SlotVerified:
        """Raise BlockRejected (`rows_missing`) unless the rows match the signed digest: the
        slot checksum on the rows' device, or the header's hash over rows in host memory.
        Authentic: rows in a slot never left this host, so other rows mean this block's were
        lost (its slot reused or written over), not that a forger chose them."""
        if rows_digest(self.rows, self.header.forward_state_algorithm, self.ready) != (
            self.header.forward_state_digest
        ):
            raise envelope.BlockRejected(
                envelope.RejectReason.ROWS_MISSING,
                f"slot {self.header.locator.slot} holds other rows",
                authentic=True,
            )
        return self
