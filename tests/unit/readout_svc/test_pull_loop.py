"""The readout's pull loop outlives whatever a fetch raises, `asyncio.TimeoutError` included
(a fetch whose deadline passes while the loop is busy raises it, not nats' own
TimeoutError): a loop it ended would leave the process idle after a NATS outage while its
health said SERVING."""

from __future__ import annotations

import asyncio

import nats

from readout_svc.pull import run_worker


class FlakyPull:
    def __init__(self, stop: asyncio.Event) -> None:
        self.stop, self.calls = stop, 0

    async def fetch(self, n, timeout):
        self.calls += 1
        if self.calls == 1:
            raise TimeoutError  # the builtin, not nats.errors.TimeoutError
        if self.calls == 2:
            raise nats.errors.ConnectionClosedError
        if self.calls == 3:
            raise RuntimeError("anything else")
        if self.calls == 4:
            return ["block"]
        self.stop.set()
        return []


class Worker:
    worker_id = "w"

    def __init__(self) -> None:
        self.handled = []

    async def handle(self, msg, long_read=None):
        self.handled.append(msg)


async def test_the_pull_loop_survives_every_fetch_failure():
    stop = asyncio.Event()
    pull, worker = FlakyPull(stop), Worker()
    await asyncio.wait_for(run_worker(worker, pull, stop, fetch_timeout_s=0.01), 5)
    assert worker.handled == ["block"] and pull.calls == 5


class Blocks:
    """Hands out the given blocks one fetch each, then sets `stop`."""

    def __init__(self, stop: asyncio.Event, blocks: list[str]) -> None:
        self.stop, self.blocks = stop, list(blocks)

    async def fetch(self, n, timeout):
        if not self.blocks:
            self.stop.set()
            return []
        return [self.blocks.pop(0)]


class LongWorker:
    """Blocks named long* are queued as long reads and end only on `release`."""

    worker_id = "w"

    def __init__(self) -> None:
        self.done: list[str] = []
        self.release = asyncio.Event()

    async def handle(self, msg, long_read=None):
        if msg.startswith("long"):
            if long_read is not None:
                long_read.set()
            await self.release.wait()
        self.done.append(msg)


async def test_a_long_block_is_parked_while_the_loop_pulls_the_next():
    """One loop: the first long block is parked once its read is queued and the short
    blocks after it are handled meanwhile; a second long block, with one parked, is handled
    to its end in the loop; the loop ends only once the parked block is finished."""
    stop = asyncio.Event()
    worker = LongWorker()
    pull = Blocks(stop, ["long1", "short1", "short2", "long2", "short3"])
    loop = asyncio.ensure_future(run_worker(worker, pull, stop, fetch_timeout_s=0.01))
    for _ in range(500):
        if worker.done == ["short1", "short2"]:
            break
        await asyncio.sleep(0.01)
    assert worker.done == ["short1", "short2"]  # beside the parked long1; long2 in hand
    assert not loop.done()
    worker.release.set()
    await asyncio.wait_for(loop, 5)
    assert sorted(worker.done[2:]) == ["long1", "long2", "short3"]
