"""Waiting for a block's answer: its registry commit, or its rejection, whichever comes first.

A rejected block is never committed, so without listening to `stateblock.rejected.>` the
request would wait out its whole deadline. Rejections seen before anyone waits are kept
briefly: a worker can reject a block before the gateway has the capture reply in hand.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
from nats.aio.msg import Msg

from gateway.errors import ReadoutFailed
from registry import Registry
from stateblock import streams
from stateblock.v1 import commit_pb2

_REMEMBERED = 4096


class CommitWatcher:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()

    @classmethod
    @asynccontextmanager
    async def open(cls, nc: nats.NATS, registry: Registry) -> AsyncIterator[CommitWatcher]:
        watcher = cls(registry)
        sub = await nc.subscribe(streams.rejected_subject(">"), cb=watcher._on_rejected)
        try:
            yield watcher
        finally:
            await sub.unsubscribe()

    async def _on_rejected(self, msg: Msg) -> None:
        headers = msg.headers or {}
        block_id = headers.get(streams.BLOCK_ID_HEADER, "")
        reason = headers.get(streams.REASON_HEADER) or msg.subject.rsplit(".", 1)[-1]
        if not block_id:
            return
        waiter = self._waiting.get(block_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(reason)
        self._recent[block_id] = reason
        while len(self._recent) > _REMEMBERED:
            self._recent.popitem(last=False)

    async def watch_commit(self, block_id: str, timeout: float) -> commit_pb2.Commit:
        """The commit; ReadoutFailed if the block was rejected; CommitTimeout after timeout."""
        if block_id in self._recent:
            raise ReadoutFailed(f"block {block_id} was rejected: {self._recent[block_id]}")
        rejected = asyncio.get_running_loop().create_future()
        self._waiting[block_id] = rejected
        commit = asyncio.create_task(self._registry.watch_commit(block_id, timeout))
        try:
            await asyncio.wait({commit, rejected}, return_when=asyncio.FIRST_COMPLETED)
            if commit.done():
                return commit.result()
            raise ReadoutFailed(f"block {block_id} was rejected: {rejected.result()}")
        finally:
            del self._waiting[block_id]
            if not commit.done():
                # Not awaited: a cancel that lands inside nats-py's subscribe can be swallowed,
                # and the watch then lives on to its own timeout. The request must not wait.
                commit.cancel()
                commit.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # consumed, so asyncio does not log "never retrieved"
