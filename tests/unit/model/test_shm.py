"""Host shared-memory regions (the `host` data plane), in a directory standing for /dev/shm:
written once, mapped by the reader, bounded, unlinked on expiry and by their reader."""

from __future__ import annotations

import os
import time

import pytest
import torch

from stateblock.model.rows import host_chunks, rows_view
from stateblock.model.shm import (
    HostRegions,
    host_placement,
    open_region,
    region_name,
    region_path,
    unlink_region,
)
from stateblock.model.slots import SlotPoolFull, rows_checksum
from stateblock.protocol import layouts


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def layout_of(rows: torch.Tensor):
    return layouts.make_layout(
        "req", [rows.shape[0]], [4], hidden_size=rows.shape[1], dtype=rows.dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_a_region_is_written_once_and_mapped_by_its_reader(tmp_path, dtype):
    regions = HostRegions(4, 60.0, shm_dir=tmp_path)
    rows = torch.randn(5, 8).to(dtype)
    name = await regions.reserve("b1", time.time() + 60, 1.0)
    assert name == region_name("b1")
    regions.write(name, rows_view(rows))
    with pytest.raises(FileExistsError):
        regions.write(name, rows_view(rows))  # a region is its block's alone
    mapped = open_region(name, layout_of(rows), tmp_path)
    assert torch.equal(mapped, rows) and rows_checksum(mapped) == rows_checksum(rows)
    assert regions.held() == 1
    assert unlink_region(name, tmp_path) and not unlink_region(name, tmp_path)
    assert torch.equal(mapped, rows)  # a mapping outlives its unlinked region
    assert open_region(name, layout_of(rows), tmp_path) is None
    assert regions.held() == 0  # the reader freed it


async def test_every_region_unread_holds_the_capture_then_one_read_lets_it_in(tmp_path):
    regions = HostRegions(1, 60.0, shm_dir=tmp_path)
    first = await regions.reserve("b1", time.time() + 60, 1.0)
    regions.write(first, rows_view(torch.zeros(2, 4)))
    with pytest.raises(SlotPoolFull, match="1 shared-memory regions"):
        await regions.reserve("b2", time.time() + 60, 0.05)
    unlink_region(first, tmp_path)  # what a worker does once the block has its outcome
    assert await regions.reserve("b2", time.time() + 60, 1.0) == region_name("b2")


async def test_an_expired_region_is_unlinked_and_a_dead_capture_s_swept(tmp_path):
    clock = Clock()
    regions = HostRegions(2, 60.0, shm_dir=tmp_path, clock=clock)
    name = await regions.reserve("b1", clock.now + 5, 1.0)
    regions.write(name, rows_view(torch.zeros(2, 4)))
    clock.now += 5
    assert regions.held() == 0 and not (tmp_path / name).exists()
    old, fresh = tmp_path / region_name("old"), tmp_path / region_name("fresh")
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 120, time.time() - 120))
    HostRegions(2, 60.0, shm_dir=tmp_path)
    assert not old.exists() and fresh.exists()


async def test_a_region_that_never_went_out_is_released(tmp_path):
    regions = HostRegions(1, 60.0, shm_dir=tmp_path)
    name = await regions.reserve("b1", time.time() + 60, 1.0)
    regions.write(name, rows_view(torch.zeros(2, 4)))
    regions.release(name)
    assert regions.held() == 0 and not (tmp_path / name).exists()


def test_only_a_region_of_the_layout_s_size_and_name_is_opened(tmp_path):
    rows = torch.zeros(3, 4)
    (tmp_path / region_name("b1")).write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="bytes"):
        open_region(region_name("b1"), layout_of(rows), tmp_path)
    for name in ("../etc/passwd", "other-b1", "stateblock-a/b"):
        with pytest.raises(ValueError, match="not a stateblock region"):
            region_path(name, tmp_path)


def test_the_placement_is_the_boot_and_the_mount(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    here = host_placement(tmp_path / "a")
    assert here == host_placement(tmp_path / "a") and len(here) == 16
    assert here != host_placement(tmp_path / "b")


async def test_a_region_reserved_but_not_yet_written_still_counts(tmp_path):
    """Between its reservation and its write (the digest runs in between) a region is not
    on disk yet: it is out all the same, not a region its reader has freed."""
    regions = HostRegions(1, 60.0, shm_dir=tmp_path)
    first = await regions.reserve("b1", time.time() + 60, 1.0)
    with pytest.raises(SlotPoolFull):
        await regions.reserve("b2", time.time() + 60, 0.05)
    assert regions.held() == 1
    regions.write(first, rows_view(torch.zeros(2, 4)))
    unlink_region(first, tmp_path)
    assert await regions.reserve("b2", time.time() + 60, 1.0) == region_name("b2")
    regions.release(region_name("b2"))  # never went out
    assert regions.held() == 0


async def test_other_files_and_other_captures_regions_do_not_count(tmp_path):
    regions = HostRegions(2, 60.0, shm_dir=tmp_path)
    (tmp_path / region_name("someone-else")).write_bytes(b"x")
    (tmp_path / "not-a-region").write_bytes(b"x")
    name = await regions.reserve("b1", time.time() + 60, 1.0)
    regions.write(name, rows_view(torch.zeros(2, 4)))
    assert regions.held() == 1
    await regions.reserve("b2", time.time() + 60, 1.0)
    with pytest.raises(SlotPoolFull):
        await regions.reserve("b3", time.time() + 60, 0.05)


async def test_a_region_written_in_pieces_holds_the_rows(tmp_path):
    regions = HostRegions(4, 60.0, shm_dir=tmp_path)
    rows = torch.randn(5, 8).to(torch.bfloat16)
    name = await regions.reserve("b1", time.time() + 60, 1.0)
    regions.write_chunks(name, host_chunks(rows, 7))
    assert torch.equal(open_region(name, layout_of(rows), tmp_path), rows)
    assert regions.held() == 1


async def test_a_write_that_fails_midway_is_released_with_nothing_left(tmp_path):
    """The pieces stop with an error (the copy failed): the region given back is gone."""
    regions = HostRegions(1, 60.0, shm_dir=tmp_path)
    name = await regions.reserve("b1", time.time() + 60, 1.0)

    def failing():
        yield b"\0" * 16
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        regions.write_chunks(name, failing())
    regions.release(name)
    assert not region_path(name, tmp_path).exists() and regions.held() == 0
    assert await regions.reserve("b2", time.time() + 60, 0.1) == region_name("b2")
