"""The device arena of the `ipc` data plane, on the CPU (the handle's opening is the GPU
test's): spans placed first-fit and aligned, bounded by room and by slots, freed by their
block alone or at its expiry, and rows copied out whole, whatever becomes of the span."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from stateblock.model import arena as arenas
from stateblock.model.arena import ALIGN, ArenaUnreachable, DeviceArena, copy_rows, share
from stateblock.model.slots import SlotPoolFull
from stateblock.protocol import layouts
from stateblock.v1 import block_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def layout_of(rows: torch.Tensor) -> pb.Layout:
    return layouts.make_layout(
        "req", [rows.shape[0]], [4], hidden_size=rows.shape[1], dtype=rows.dtype
    )


@pytest.fixture
def arena():
    a = DeviceArena(4 * ALIGN, device="cpu", slots=3)
    yield a
    a.close()


async def test_spans_are_aligned_first_fit_and_a_freed_gap_is_reused(arena):
    far = time.time() + 60
    a = await arena.reserve("a", 100, far, 1.0)
    b = await arena.reserve("b", ALIGN + 1, far, 1.0)
    assert (a, b) == (0, ALIGN)
    c = await arena.reserve("c", 10, far, 1.0)
    assert c == 3 * ALIGN  # after b's two aligned units
    assert arena.free(a, "a") and not arena.free(a, "a")
    assert await arena.reserve("d", ALIGN, far, 1.0) == 0  # the gap a left
    assert arena.held() == 3


async def test_a_full_arena_waits_for_a_free_then_fails_with_its_reason(arena):
    far = time.time() + 60
    first = await arena.reserve("a", 3 * ALIGN, far, 1.0)
    with pytest.raises(SlotPoolFull, match="no room for 1024 bytes"):
        await arena.reserve("b", 2 * ALIGN, far, 0.05)
    waiting = asyncio.create_task(arena.reserve("b", 2 * ALIGN, far, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    arena.free(first, "a")
    assert await waiting == 0
    with pytest.raises(ValueError, match="do not fit"):
        await arena.reserve("huge", 5 * ALIGN, far, 0.05)


async def test_slots_bound_the_blocks_held_whatever_the_room(arena):
    far = time.time() + 60
    for name in "abc":
        await arena.reserve(name, 1, far, 1.0)
    with pytest.raises(SlotPoolFull):
        await arena.reserve("d", 1, far, 0.05)


async def test_an_expired_span_goes_back_and_its_stale_free_touches_nothing():
    clock = Clock()
    arena = DeviceArena(2 * ALIGN, device="cpu", slots=2, clock=clock)
    try:
        old = await arena.reserve("old", 2 * ALIGN, clock.now + 5, 1.0)
        clock.now += 5
        new = await arena.reserve("new", ALIGN, clock.now + 5, 1.0)
        assert new == old == 0
        assert not arena.free(old, "old")  # the late release of the expired block
        assert arena.held() == 1
    finally:
        arena.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_rows_are_copied_in_and_out_whole(arena, dtype):
    rows = torch.randn(6, 8).to(dtype)
    layout = layout_of(rows)
    nbytes = arenas.rows_nbytes(layout)
    offset = await arena.reserve("a", nbytes, time.time() + 60, 1.0)
    arena.fill(offset, "a", rows)
    ipc = share(arena)
    ipc.rows_offset_bytes = offset
    out = copy_rows(ipc, layout, "cpu")
    assert out.dtype == dtype and torch.equal(out, rows)
    arena.buffer.zero_()  # the span written over after the copy: the copy stands
    assert torch.equal(out, rows)
    with pytest.raises(KeyError):
        arena.fill(offset, "b", rows)  # a span is its block's alone
    with pytest.raises(ValueError, match="bytes of rows for a span"):
        arena.fill(offset, "a", rows[:3])


def test_an_arena_out_of_reach_says_why(arena):
    ipc = pb.CudaIpcRows(pool="another-process")
    with pytest.raises(ArenaUnreachable, match="not shared"):
        arenas.open_arena(ipc)
    ipc.mem_handle, ipc.device_uuid = b"\1" * 64, "GPU-0000"
    if not torch.cuda.is_available():
        with pytest.raises(ArenaUnreachable, match="has no CUDA"):
            arenas.open_arena(ipc)
    outside = share(arena)
    outside.rows_offset_bytes = 3 * ALIGN
    rows = torch.zeros(64, 8)
    with pytest.raises(ValueError, match="outside"):
        copy_rows(outside, layout_of(rows), "cpu")


def test_the_placement_is_the_host_s_alike_in_every_process():
    assert arenas.ipc_placement() == arenas.ipc_placement()
    assert arenas.ipc_placement().startswith("ipc-")
