"""The readout's pull loop outlives whatever a fetch raises, `asyncio.TimeoutError` included
(a fetch whose deadline passes while the loop is busy raises it, not nats' own
TimeoutError): a loop it ended would leave the process idle after a NATS outage while its
health said SERVING."""

from __future__ import annotations

import asyncio

import nats

from readout_svc.worker import run_worker


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

    async def handle(self, msg):
        self.handled.append(msg)


async def test_the_pull_loop_survives_every_fetch_failure():
    stop = asyncio.Event()
    pull, worker = FlakyPull(stop), Worker()
    await asyncio.wait_for(run_worker(worker, pull, stop, fetch_timeout_s=0.01), 5)
    assert worker.handled == ["block"] and pull.calls == 5
