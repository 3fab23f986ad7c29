"""Waiting for a block's outcome: the commit or the rejection the registry stored for it.

The gateway believes only what JetStream stored in the registry bucket (an ordered consumer
on the bucket's stream: a write JetStream refused is never seen) and what a trusted readout
key signed (stateblock.protocol.outcomes). An unsigned or forged record is ignored and
counted; it can neither answer a request nor fail it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from prometheus_client import CollectorRegistry, Counter

from gateway.errors import BlockRejected
from registry import FINAL_STATES, CommitTimeout, Registry, RegistryError
from stateblock.protocol import outcomes
from stateblock.protocol.keys import TrustStore
from stateblock.v1 import commit_pb2

log = structlog.get_logger("gateway")
_REMEMBERED = 4096
Outcome = commit_pb2.Commit | commit_pb2.Rejection


class CommitWatcher:
    """One watch on the registry bucket for the whole gateway: signed commits and
    rejections resolve per-block futures. No consumer is created per request (that cost a
    JetStream API round trip to create and another to delete). A waiter also re-reads the
    registry now and then: an outcome missed across a reconnect costs latency, never the
    answer."""

    def __init__(
        self,
        registry: Registry,
        trust: TrustStore,
        *,
        metrics: CollectorRegistry | None = None,
        recheck_s: float = 1.0,
    ) -> None:
        self._registry = registry
        self._trust = trust
        self._recheck_s = recheck_s
        # every request waiting on a block, each with its own future: retries that share
        # one Idempotency-Key wait on one block together
        self._waiting: dict[str, list[asyncio.Future[Outcome]]] = {}
        self._recent: OrderedDict[str, Outcome] = OrderedDict()
        self.untrusted = Counter(
            "stateblock_untrusted_outcomes",
            "Registry records ignored because no trusted readout key signed them.",
            registry=metrics if metrics is not None else CollectorRegistry(),
        )

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        registry: Registry,
        trust: TrustStore,
        *,
        metrics: CollectorRegistry | None = None,
    ) -> AsyncIterator[CommitWatcher]:
        watcher = cls(registry, trust, metrics=metrics)
        stop = await registry.watch_stored(watcher._on_stored)
        try:
            yield watcher
        finally:
            await stop()

    def _trusted(self, block_id: str, entry: commit_pb2.RegistryEntry) -> Outcome | None:
        try:
            return outcomes.outcome_of(entry, self._trust, block_id)
        except outcomes.UntrustedOutcome as e:
            self.untrusted.inc()
            log.warning("untrusted registry record ignored", block_id=block_id, why=str(e))
            return None

    async def _on_stored(self, block_id: str, entry: commit_pb2.RegistryEntry | None) -> None:
        outcome = None if entry is None else self._trusted(block_id, entry)
        if outcome is not None:
            self._settle(block_id, outcome)

    def _settle(self, block_id: str, outcome: Outcome) -> None:
        """Kept briefly too: a block can finish before the gateway has the capture reply
        (and the block id) in hand."""
        for waiter in self._waiting.get(block_id, ()):
            if not waiter.done():
                waiter.set_result(outcome)
        self._recent[block_id] = outcome
        while len(self._recent) > _REMEMBERED:
            self._recent.popitem(last=False)

    async def _reread(self, block_id: str) -> Outcome | None:
        """The newest trusted outcome among the key's stored revisions: one a forger's later
        write replaced is still found (a retry following its block after an outage)."""
        try:
            entries = await self._registry.history(block_id)
        except RegistryError as e:  # a leader election or an outage: wait, read again later
            log.info("registry re-read failed", block_id=block_id, error=str(e))
            return None
        for entry in entries:
            if entry.state in FINAL_STATES:
                outcome = self._trusted(block_id, entry)
                if outcome is not None:
                    return outcome
        return None

    async def watch_commit(self, block_id: str, timeout: float) -> commit_pb2.Commit:
        """The commit; BlockRejected if the block was rejected; CommitTimeout after timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        outcome = self._recent.get(block_id)
        if outcome is None:
            waiter = loop.create_future()
            waiters = self._waiting.setdefault(block_id, [])
            waiters.append(waiter)
            try:
                while outcome is None and (remaining := deadline - loop.time()) > 0:
                    try:
                        outcome = await asyncio.wait_for(
                            asyncio.shield(waiter), min(remaining, self._recheck_s)
                        )
                    except TimeoutError:
                        outcome = await self._reread(block_id)
            finally:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[block_id]
        if outcome is None:
            raise CommitTimeout(f"no commit for block {block_id} within {timeout:g}s")
        if isinstance(outcome, commit_pb2.Rejection):
            raise BlockRejected(block_id, outcome.reason, outcome.detail)
        return outcome
