"""Rows in host shared memory: the `host` data plane (a capture and readout processes on
one host, sharing /dev/shm).

The capture writes each block's rows once into a region of their own, a file in /dev/shm
(POSIX shared memory, what shm_open names) called after the block (`region_name`), and
signs a header whose locator names the region and this host's placement (`host_placement`:
the boot and the /dev/shm mount, so processes that see the same regions agree on it
without talking, and a pod with a /dev/shm of its own is a placement of its own). A worker
maps the region copy-on-write (no copy: pages are shared until written, and nothing
writes them), checks the signed digest over it (the header's hash of the bytes written) and unlinks the region once the block has
its outcome. The capture bounds the regions it has out (`HostRegions`): a reservation
waits while that many are unread, and it unlinks those past their block's expiry.

Rows on a GPU pass through the host on this plane; the `ipc` plane keeps them on the GPU
(stateblock.model.arena).
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

from stateblock.model.rows import torch_dtype
from stateblock.model.slots import Waiting
from stateblock.v1 import block_pb2 as pb

SHM_DIR = Path("/dev/shm")
PREFIX = "stateblock-"
_REGION = re.compile(r"^stateblock-[A-Za-z0-9_-]{1,80}$")
POLL_S = 0.005  # a region freed by another process is seen at the next look


def host_placement(shm_dir: Path = SHM_DIR) -> str:
    """This host's placement id: its boot and its shared-memory mount (FileNotFoundError
    without one)."""
    if not shm_dir.is_dir():
        raise FileNotFoundError(f"{shm_dir}: no shared memory on this host")
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else ""
    stat = shm_dir.stat()
    return hashlib.sha256(f"{boot_id}:{stat.st_dev}:{stat.st_ino}".encode()).hexdigest()[:16]


def region_name(block_id: str) -> str:
    return f"{PREFIX}{block_id}"


def region_path(name: str, shm_dir: Path = SHM_DIR) -> Path:
    """The file of a region a header names; ValueError for a name no capture writes."""
    if not _REGION.match(name):
        raise ValueError(f"region {name!r} is not a stateblock region")
    return shm_dir / name


def open_region(name: str, layout: pb.Layout, shm_dir: Path = SHM_DIR) -> Tensor | None:
    """The rows in the region, mapped copy-on-write, (rows, hidden) of the layout's dtype;
    None when the region is gone. ValueError when its size is not the layout's."""
    try:
        fd = os.open(region_path(name, shm_dir), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        dtype = torch_dtype(layout.dtype)
        want = layout.total_rows * layout.hidden_size * dtype.itemsize
        if size != want:
            raise ValueError(f"region {name} holds {size} bytes, the layout {want}")
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=dtype).view(layout.total_rows, layout.hidden_size)


def unlink_region(name: str, shm_dir: Path = SHM_DIR) -> bool:
    """Remove the region (mappings stay valid); False when it was gone already."""
    try:
        region_path(name, shm_dir).unlink()
    except FileNotFoundError:
        return False
    return True


class HostRegions:
    """The capture's regions in /dev/shm: at most `limit` unread at once."""

    def __init__(
        self,
        limit: int,
        ttl_s: float,
        *,
        shm_dir: Path = SHM_DIR,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.placement = host_placement(shm_dir)
        self._limit, self._dir, self._clock = limit, shm_dir, clock
        self._out: dict[str, float] = {}  # region -> its block's expiry
        self._written: set[str] = set()  # the regions of _out on disk
        self._looked_at = float("-inf")  # the event loop's time of the last listing
        self._waiting = Waiting()
        self.sweep(ttl_s)

    def sweep(self, ttl_s: float) -> int:
        """Unlink the regions written over `ttl_s` ago, whoever wrote them: their blocks
        have expired (a capture that died leaves its unread regions behind)."""
        cutoff, swept = self._clock() - ttl_s, 0
        for path in self._dir.glob(f"{PREFIX}*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    swept += 1
            except FileNotFoundError:
                pass  # read and unlinked meanwhile
        return swept

    def held(self) -> int:
        """Regions not yet freed by their reader (expired ones unlinked first)."""
        self._expire()
        self._look()
        return len(self._out)

    async def reserve(self, block_id: str, expires_at: float, timeout_s: float) -> str:
        """The region name of `block_id`, once fewer than `limit` are unread (waiting up to
        `timeout_s`, then SlotPoolFull). Under the limit nothing on disk is looked at; at
        it, the directory is listed at most once every POLL_S, however many wait."""
        loop = asyncio.get_running_loop()

        def take() -> str | None:
            self._expire()
            if len(self._out) >= self._limit and loop.time() - self._looked_at >= POLL_S:
                self._looked_at = loop.time()
                self._look()
            if len(self._out) >= self._limit:
                return None
            name = region_name(block_id)
            self._out[name] = expires_at
            return name

        def full() -> str:
            return (
                f"all {self._limit} shared-memory regions hold blocks not yet read "
                f"after {timeout_s:g} s"
            )

        # a region is freed by its reader's process, which wakes nothing here: look again
        # every POLL_S
        return await self._waiting.until(take, lambda: POLL_S, timeout_s, full)

    def _expire(self) -> None:
        now = self._clock()
        for name, expires_at in list(self._out.items()):
            if expires_at <= now:
                unlink_region(name, self._dir)
                self._forget(name)

    def _look(self) -> None:
        """Drop the written regions their reader has unlinked, from one listing of the
        directory (a region reserved but not yet written is out all the same)."""
        if not self._written:
            return
        present = {e.name for e in os.scandir(self._dir) if e.name.startswith(PREFIX)}
        for name in self._written - present:
            self._forget(name)

    def _forget(self, name: str) -> None:
        self._out.pop(name, None)
        self._written.discard(name)

    def write(self, name: str, data: bytes | memoryview) -> None:
        """The rows' bytes (stateblock.model.rows.rows_view) into their new region, once."""
        self.write_chunks(name, (data,))

    def write_chunks(self, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """The rows' bytes, in order, as pieces (stateblock.model.rows.host_chunks), into
        their new region, once."""
        with open(region_path(name, self._dir), "xb") as f:
            for chunk in chunks:
                f.write(chunk)
        if name in self._out:  # not expired meanwhile
            self._written.add(name)

    def release(self, name: str) -> None:
        """The region of a block that never went out."""
        self._forget(name)
        unlink_region(name, self._dir)
