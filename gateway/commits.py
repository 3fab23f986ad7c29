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
from registry import CommitTimeout, Registry, RegistryError, parse_update
from stateblock.protocol import streams
from stateblock.v1 import commit_pb2

_REMEMBERED = 4096


class CommitWatcher:
    """One subscription to the registry's write subject for the whole gateway: commits and
    rejections resolve per-block futures. No consumer is created per request (that cost a
    JetStream API round trip to create and another to delete). Core NATS delivers at most
    once, so a waiter also re-reads the registry now and then: a commit missed across a
    reconnect costs latency, never the answer."""

    def __init__(self, registry: Registry, *, recheck_s: float = 1.0) -> None:
        self._registry = registry
        self._recheck_s = recheck_s
        self._waiting: dict[str, asyncio.Future[commit_pb2.Commit | str]] = {}
        self._recent: OrderedDict[str, commit_pb2.Commit | str] = OrderedDict()

    @classmethod
    @asynccontextmanager
    async def open(cls, nc: nats.NATS, registry: Registry) -> AsyncIterator[CommitWatcher]:
        watcher = cls(registry)
        subs = [
            await nc.subscribe(streams.rejected_subject(">"), cb=watcher._on_rejected),
            await nc.subscribe(registry.updates_subject, cb=watcher._on_update),
        ]
        await nc.flush()  # the server has our interest before the first request is served
        try:
            yield watcher
        finally:
            for sub in subs:
                await sub.unsubscribe()

    def _settle(self, block_id: str, outcome: commit_pb2.Commit | str) -> None:
        """A commit, or the reason a block was rejected. Kept briefly too: a block can
        finish before the gateway has the capture reply (and the block id) in hand."""
        waiter = self._waiting.get(block_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)
        self._recent[block_id] = outcome
        while len(self._recent) > _REMEMBERED:
            self._recent.popitem(last=False)

    async def _on_rejected(self, msg: Msg) -> None:
        headers = msg.headers or {}
        block_id = headers.get(streams.BLOCK_ID_HEADER, "")
        reason = headers.get(streams.REASON_HEADER) or msg.subject.rsplit(".", 1)[-1]
        if block_id:
            self._settle(block_id, reason)

    async def _on_update(self, msg: Msg) -> None:
        try:
            block_id, entry = parse_update(msg.subject, msg.data, msg.headers)
        except RegistryError:
            return  # not ours to judge here; the worker that wrote it reports it
        if entry is not None and entry.state == commit_pb2.CLAIM_STATE_COMMITTED:
            self._settle(block_id, entry.commit)

    async def watch_commit(self, block_id: str, timeout: float) -> commit_pb2.Commit:
        """The commit; ReadoutFailed if the block was rejected; CommitTimeout after timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        outcome = self._recent.get(block_id)
        if outcome is None:
            waiter = self._waiting[block_id] = loop.create_future()
            try:
                while outcome is None and (remaining := deadline - loop.time()) > 0:
                    try:
                        outcome = await asyncio.wait_for(
                            asyncio.shield(waiter), min(remaining, self._recheck_s)
                        )
                    except TimeoutError:
                        entry = await self._registry.get(block_id)
                        if entry is not None and entry.state == commit_pb2.CLAIM_STATE_COMMITTED:
                            outcome = entry.commit
            finally:
                del self._waiting[block_id]
        if outcome is None:
            raise CommitTimeout(f"no commit for block {block_id} within {timeout:g}s")
        if isinstance(outcome, str):
            raise ReadoutFailed(f"block {block_id} was rejected: {outcome}")
        return outcome
