"""The slot pool and its checksum: reservation, waiting while full, owner-only frees,
expiry, and a checksum that tells rows apart on their own device."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from stateblock.model.slots import MAX_WORDS, SlotPool, SlotPoolFull, rows_checksum


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(seed: int, n: int = 7, d: int = 16, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_checksum_is_32_bytes_of_the_rows_alone(dtype):
    a = rows(0, dtype=dtype)
    assert len(rows_checksum(a)) == 32
    assert rows_checksum(a) == rows_checksum(a.clone())
    assert rows_checksum(a) != rows_checksum(rows(1, dtype=dtype))


def test_the_checksum_sees_one_flipped_bit_and_swapped_rows():
    a = rows(3)
    flipped = a.clone()
    flipped.view(-1).view(torch.int32)[5] ^= 1
    assert rows_checksum(flipped) != rows_checksum(a)
    assert rows_checksum(a[[1, 0, 2, 3, 4, 5, 6]]) != rows_checksum(a)


def test_the_checksum_of_a_view_is_that_of_its_rows():
    a = rows(4, n=10)
    assert rows_checksum(a[2:5]) == rows_checksum(a[2:5].clone())


def test_the_checksum_refuses_a_block_past_its_exact_range(monkeypatch):
    monkeypatch.setattr("stateblock.model.slots.MAX_WORDS", 8)
    with pytest.raises(ValueError, match="words"):
        rows_checksum(rows(0))
    assert MAX_WORDS == 1 << 28


async def test_slots_are_reserved_filled_and_freed_by_their_block_only():
    pool = SlotPool(2, clock=Clock())
    a = await pool.reserve("a", 2000.0, 1.0)
    b = await pool.reserve("b", 2000.0, 1.0)
    assert {a, b} == {0, 1} and pool.held() == 2
    assert pool.rows(a) is None  # reserved, not filled
    pool.fill(a, "a", rows(0))
    held = pool.rows(a)
    assert held is not None and held[0] == "a"
    with pytest.raises(KeyError):
        pool.fill(b, "a", rows(0))  # another block's slot
    assert not pool.free(a, "b")  # a stale block frees nothing of another's
    assert pool.free(a, "a") and not pool.free(a, "a")
    assert pool.held() == 1 and pool.rows(a) is None


async def test_a_full_pool_waits_then_fails_and_a_free_lets_the_waiter_in():
    pool = SlotPool(1, clock=Clock())
    slot = await pool.reserve("a", 2000.0, 1.0)
    with pytest.raises(SlotPoolFull, match="1 slots"):
        await pool.reserve("b", 2000.0, 0.05)
    assert pool.held() == 1 and pool.free(slot, "a") is True
    await pool.reserve("b", 2000.0, 0.05)
    waiter = asyncio.ensure_future(pool.reserve("c", 2000.0, 10.0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    pool.free(slot, "b")
    assert await asyncio.wait_for(waiter, 1.0) == slot


async def test_an_expired_block_gives_its_slot_back():
    clock = Clock()
    pool = SlotPool(1, clock=clock)
    slot = await pool.reserve("a", clock.now + 5, 1.0)
    pool.fill(slot, "a", rows(0))
    clock.now += 5
    assert pool.held() == 0
    assert await pool.reserve("b", clock.now + 5, 0.01) == slot
    assert not pool.free(slot, "a")  # the expired block cannot free its successor


async def test_a_waiter_takes_the_slot_of_a_block_that_expires_meanwhile():
    pool = SlotPool(1)  # the real clock: nothing frees the slot but its block's expiry
    slot = await pool.reserve("a", time.time() + 0.1, 1.0)
    assert await pool.reserve("b", time.time() + 60, 30.0) == slot


def test_a_pool_needs_a_slot():
    with pytest.raises(ValueError):
        SlotPool(0)
