"""A readout worker: verify -> claim -> readout -> commit -> ack_sync, one block at a time.

A block that fails verification is terminated (retrying cannot make it valid), published to
`stateblock.rejected.<reason>` and counted; nothing of it is committed. A redelivered block
whose registry entry is committed is acked and dropped. Anything transient (NATS, a live
claim elsewhere, a failed readout) naks the message so JetStream redelivers it.

The header checks (signature, expiry, layout, model) come before the claim. Then three
things run at once: the claim (a KV round trip), the readout (in the engine's thread) and
the rows' digest (in a thread of its own; milliseconds at full scale, docs/BENCHMARKS.md).
Nothing built from the block leaves the worker before both the claim and the digest
succeed: a readout whose claim is refused is dropped unread (a duplicate delivery costs one
wasted readout, the reply path loses a round trip), and a block whose rows do not match
its signed digest releases its claim before it is rejected, its answer dropped. Rows kept
on this host (readout_svc.rows: a slot, a shared-memory region) never crossed a network,
so other rows there mean the block's own were lost: that block ends in a signed rejection
its request hears, and its slot is freed with its commit or rejection.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js.object_store import ObjectStore
from prometheus_client import CollectorRegistry, Counter, Histogram

from readout_svc.cohorts import DirectReadouts, ReadoutCohorts
from readout_svc.records import commit_record, rejection_record
from readout_svc.rows import BlockRows, Rejected
from registry import (
    AlreadyClaimed,
    AlreadyCommitted,
    Claim,
    ClaimLost,
    Registry,
    RegistryError,
)
from stateblock import runtime
from stateblock.engines import LaneResult, ReadoutEngine, lane_requests
from stateblock.model.slots import SlotPool, SlotVerified
from stateblock.protocol import envelope, outcomes, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.sampling import Limits
from stateblock.v1 import block_pb2 as block_pb
from stateblock.v1 import commit_pb2 as outcome_pb

log = structlog.get_logger("readout_svc")
READOUT_FAILED = "readout_failed"  # the engine failed on every delivery
# an answer this many tokens or longer: its commit record is built and signed on a thread
# (a maximal answer, 8 x 8,192 tokens, took 7-8 ms on a loop the worker's others share)
OFF_LOOP_TOKENS = 8192


class EngineHealth:
    """Whether the engine answers: LIMIT failed readouts in a row, with none between, say it
    does not (the readout health check turns NOT_SERVING until one succeeds)."""

    LIMIT = 3

    def __init__(self) -> None:
        self.failures = 0
        self.listeners: list[Callable[[bool], None]] = []

    @property
    def ok(self) -> bool:
        return self.failures < self.LIMIT

    def record(self, succeeded: bool) -> None:
        before = self.ok
        self.failures = 0 if succeeded else self.failures + 1
        if self.ok != before:
            for listener in self.listeners:
                listener(self.ok)


class WorkerMetrics:
    def __init__(self, metrics: CollectorRegistry) -> None:
        self.readout_seconds = Histogram(
            "stateblock_readout_seconds",
            "Readout engine time per block.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=metrics,
        )
        self.cohort_blocks = Histogram(
            "stateblock_readout_cohort_blocks",
            "Blocks read by one engine execution (readout_svc.cohorts).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=metrics,
        )
        self.stage_seconds = runtime.stage_histogram(
            "stateblock_readout_stage_seconds",
            "Worker time per committed block by stage: verify (parse, signature, rows), "
            "claim, readout (begun beside the claim), digest (the rows' hash, in a thread "
            "beside claim and readout), digest_wait (what the commit waited for it), "
            "commit, ack. Label `route`: `parts` for a long block read in parts (more answer "
            "positions than one part), `cohort` for the rest, so the small blocks' time reads "
            "apart from the maximal ones'.",
            metrics,
            labels=("route",),
        )
        counter = functools.partial(Counter, registry=metrics)
        self.rejected = counter(
            "stateblock_blocks_rejected", "Blocks terminated by reason.", ["reason"]
        )
        self.committed = counter("stateblock_blocks_committed", "Blocks committed.")
        self.claims_lost = counter(
            "stateblock_claims_lost", "Commits refused: the claim was taken over."
        )
        self.duplicates_dropped = counter(
            "stateblock_duplicate_deliveries_dropped",
            "Redelivered blocks already committed, acked and dropped.",
        )
        self.retried = counter(
            "stateblock_blocks_retried", "Blocks nak'ed for redelivery, by cause.", ["cause"]
        )
        self.untrusted_entries = counter(
            "stateblock_registry_untrusted_entries",
            "Registry entries no trusted readout key wrote, claimed over, by kind "
            "(undecodable, untrusted_claim, untrusted_outcome).",
            ["kind"],
        )


def _timed_confirm(checked: envelope.HeaderVerified | SlotVerified) -> tuple[object, float]:
    t0 = time.perf_counter()
    return checked.confirm(), time.perf_counter() - t0


class ReadoutWorker:
    def __init__(
        self,
        engine: ReadoutEngine,
        registry: Registry,
        trust: TrustStore,
        signer: Signer,
        *,
        nc: nats.NATS,
        objects: ObjectStore,
        executor: Executor,
        digest_executor: Executor,
        metrics: WorkerMetrics,
        worker_id: str,
        lease_s: float,
        retry_delay_s: float,
        limits: Limits,
        max_deliver: int = 0,  # 0: unbounded (nothing to end on the last delivery)
        engine_health: EngineHealth | None = None,
        readouts: ReadoutCohorts | None = None,  # shared by the process's workers
        slots: SlotPool | None = None,  # the local data plane's, shared with the capture
        host: str | None = None,  # the host data plane's placement: this host's regions
    ) -> None:
        self._engine_health = engine_health or EngineHealth()
        self._engine = engine
        self._readouts = readouts or DirectReadouts(engine, executor)
        self._registry = registry
        self._rows = BlockRows(
            engine, trust, limits, nc=nc, objects=objects, object_timeout_s=lease_s,
            slots=slots, host=host,
        )  # fmt: skip
        self._signer = signer  # signs this worker's commits and rejections
        self._max_deliver = max_deliver
        self._nc = nc
        self._executor = executor
        self._digest_executor = digest_executor
        self._m = metrics
        self.worker_id = worker_id
        self._lease_s = lease_s
        self._retry = retry_delay_s

    async def handle(self, msg: Msg, long_read: asyncio.Event | None = None) -> str:
        """Process one delivery; returns what happened (for logs and tests). `long_read` is
        set once the block's readout is queued as a long block's (readout_svc.cohorts):
        its pull loop may then pull the next block meanwhile (readout_svc.pull)."""
        t_start = time.perf_counter()
        try:
            # inline rows stay a view of msg.data (2.75 MB not copied through protobuf)
            block, inline_rows = envelope.parse_wire(msg.data)
            block_id = block.header.block_id if block.HasField("header") else ""
        except envelope.BlockRejected as e:
            return await self._drop_unverified(msg, str(e.reason), e.detail)
        with structlog.contextvars.bound_contextvars(
            block_id=block_id, request_id=block.header.request_id
        ):
            try:
                checked = await self._rows.verify(block, inline_rows)
            except (Rejected, envelope.BlockRejected) as e:
                if e.authentic:  # a redelivery after the outcome is dropped by the claim
                    return await self._reject(msg, block.header, str(e.reason), e.detail)
                return await self._drop_unverified(msg, str(e.reason), e.detail)
            digest = asyncio.get_running_loop().run_in_executor(
                self._digest_executor, _timed_confirm, checked
            )
            try:
                return await self._claim_and_read(msg, block, checked, digest, t_start, long_read)
            finally:  # on a raise, its outcome is not wanted: drop it if it has not started
                digest.cancel()
                digest.add_done_callback(runtime.discard_outcome)

    async def _claim_and_read(
        self,
        msg: Msg,
        block: block_pb.StateBlock,
        checked: envelope.HeaderVerified | SlotVerified,
        digest: asyncio.Future[tuple[object, float]],
        t_start: float,
        long_read: asyncio.Event | None,
    ) -> str:
        header = checked.header
        t_verified = time.perf_counter()
        # Beside the claim: its answer is used only once the claim is ours.
        lanes = lane_requests(checked)
        readout = asyncio.ensure_future(self._readouts.read(lanes))
        if long_read is not None and self._readouts.is_long(lanes):
            long_read.set()
        try:
            claim = await self._claim(header.block_id)
        except (AlreadyCommitted, ValueError, AlreadyClaimed) as e:
            readout.cancel()  # not ours: dropped unread (skipped if it has not started)
            readout.add_done_callback(runtime.discard_outcome)
            return await self._not_ours(msg, header, e, digest)
        except BaseException:  # NATS trouble mid-claim: the block is redelivered
            readout.add_done_callback(runtime.discard_outcome)
            raise
        claimed_s = time.perf_counter() - t_verified
        claim, results, readout_s = await self._read_held(claim, msg, readout)
        t1 = time.perf_counter()
        try:
            _, digest_s = await digest
        except envelope.BlockRejected as e:  # signed header, other rows: nothing of it commits
            if e.authentic:  # rows in a slot that are not its own: this block's are lost
                return await self._reject(msg, header, str(e.reason), e.detail, claim)
            await self._release(claim)
            return await self._drop_unverified(msg, str(e.reason), e.detail)
        t_digest = time.perf_counter()
        if results is None:
            if self._last_delivery(msg):  # no redelivery will come: end it visibly
                return await self._reject(
                    msg, header, READOUT_FAILED, "the readout failed on every delivery", claim
                )
            await self._release(claim)
            await self._nak(READOUT_FAILED, msg)
            return READOUT_FAILED
        self._m.readout_seconds.observe(readout_s)
        stages = {"verify": t_verified - t_start, "claim": claimed_s, "readout": readout_s,
                  "digest": digest_s, "digest_wait": t_digest - t1}  # fmt: skip
        route = "parts" if self._readouts.is_long(lanes) else "cohort"
        return await self._commit(msg, block, header, claim, results, stages, route)

    async def _commit(
        self,
        msg: Msg,
        block: block_pb.StateBlock,
        header: block_pb.StateBlockHeader,
        claim: Claim,
        results: list[LaneResult],
        stages: dict[str, float],
        route: str,
    ) -> str:
        """The answer committed under the claim, the delivery acked, the block's stages
        observed and its rows let go; "claim_lost" when the lease went to another first."""
        t_commit = time.perf_counter()
        record = await self._signed_record(header, results)
        try:
            await self._registry.commit(claim, record)
        except ClaimLost:
            # Taken over after our lease ran out: the new holder commits. Redeliver rather
            # than ack, in case it dies too; the next delivery finds the commit and drops.
            self._m.claims_lost.inc()
            await self._nak("claim_lost", msg)
            log.warning("claim lost before commit")
            return "claim_lost"
        t_ack = time.perf_counter()
        await msg.ack_sync()
        stages.update(commit=t_ack - t_commit, ack=time.perf_counter() - t_ack)
        for name, seconds in stages.items():
            self._m.stage_seconds.labels(name, route).observe(seconds)
        self._m.committed.inc()
        self._rows.free(header)
        await self._rows.cleanup(block)
        log.info("block committed", lanes=len(header.layout.lanes))
        return "committed"

    async def _signed_record(
        self, header: block_pb.StateBlockHeader, results: list[LaneResult]
    ) -> outcome_pb.Commit:
        """The block's commit record, signed; built on a thread for a long answer
        (OFF_LOOP_TOKENS), where it would hold this loop for milliseconds."""

        def build() -> outcome_pb.Commit:
            record = commit_record(header, results, self.worker_id)
            outcomes.sign(record, self._signer)
            return record

        if sum(len(r.token_ids) for r in results) < OFF_LOOP_TOKENS:
            return build()
        return await asyncio.to_thread(build)

    async def _not_ours(
        self,
        msg: Msg,
        header: block_pb.StateBlockHeader,
        refused: Exception,
        digest: asyncio.Future[tuple[object, float]],
    ) -> str:
        """A delivery whose claim was refused: committed already, claimed elsewhere, or a
        block id no registry key can be. Rows that fail their digest are rejected as such,
        as when the digest came before the claim; a block's own outcome comes only after."""
        try:
            await digest
        except envelope.BlockRejected as bad:
            if not bad.authentic:  # a slot's lost rows: the claim's holder decides
                return await self._drop_unverified(msg, str(bad.reason), bad.detail)
        if isinstance(refused, AlreadyCommitted):
            return await self._drop_duplicate(msg, header)
        if isinstance(refused, AlreadyClaimed):
            # not before the holder's lease can lapse: every nak spends one of the
            # block's max_deliver deliveries, and a holder that is only slow commits
            await self._nak("claimed_elsewhere", msg, after_s=refused.lease_left_s)
            log.info("block claimed elsewhere, redelivering later", holder=refused.holder)
            return "claimed_elsewhere"
        # a block id that cannot be a registry key: no entry can say anything of it
        return await self._drop_unverified(msg, "malformed", str(refused))

    async def _read_held(
        self, claim: Claim, msg: Msg, readout: asyncio.Future[tuple[list[LaneResult], float]]
    ) -> tuple[Claim, list[LaneResult] | None, float]:
        """The readout's results (None: it failed) and seconds, the lease renewed while it
        runs; the claim as last renewed."""
        held, read = [claim], asyncio.Event()
        keepalive = asyncio.create_task(self._keep_alive(held, msg, read))
        results: list[LaneResult] | None = None
        readout_s = 0.0
        try:
            results, readout_s = await readout
            self._engine_health.record(True)
        except Exception:
            self._engine_health.record(False)
            log.exception("readout failed")
        finally:
            read.set()
            keepalive.cancel()
        await asyncio.gather(keepalive, return_exceptions=True)
        return held[0], results, readout_s

    async def _claim(self, block_id: str) -> Claim:
        claim = await self._registry.claim(block_id, self.worker_id, self._lease_s)
        if claim.displaced:  # a forger's write, or bytes that are no entry: nobody's lease
            self._m.untrusted_entries.labels(claim.displaced).inc()
            log.warning("untrusted registry entry claimed over", kind=claim.displaced)
        return claim

    async def _release(self, claim: Claim) -> None:
        """Give the claim back; one taken over already (our lease ran out) is not ours."""
        try:
            await self._registry.release(claim)
        except ClaimLost:
            log.info("claim already taken over; nothing to release")

    async def _keep_alive(self, held: list[Claim], msg: Msg, read: asyncio.Event) -> None:
        """Renew the lease (and JetStream's ack timer) while a long readout runs, until
        `read`. The event, not the cancel alone, ends it: Python 3.11's asyncio.wait_for
        (under nats-py's requests) drops a cancel that arrives with the reply, and a renewal
        loop that outlived its readout would hold the claim, and this worker, forever."""
        while not read.is_set():
            await asyncio.sleep(self._lease_s / 3)
            if read.is_set():
                return
            try:
                held[0] = await self._registry.renew(held[0], self._lease_s)
                await msg.in_progress()
            except ClaimLost:
                return  # the commit will say so
            except (RegistryError, TimeoutError, nats.errors.Error) as e:
                log.warning("lease renewal failed", error=repr(e))

    def _last_delivery(self, msg: Msg) -> bool:
        return bool(self._max_deliver) and msg.metadata.num_delivered >= self._max_deliver

    async def _drop_duplicate(self, msg: Msg, header: block_pb.StateBlockHeader) -> str:
        self._rows.free(header)
        await msg.ack_sync()
        self._m.duplicates_dropped.inc()
        log.info("duplicate delivery dropped")
        return "duplicate"

    async def _nak(self, cause: str, msg: Msg, after_s: float = 0.0) -> None:
        self._m.retried.labels(cause).inc()
        await msg.nak(delay=max(self._retry, after_s))

    async def _reject(
        self,
        msg: Msg,
        header: block_pb.StateBlockHeader,
        reason: str,
        detail: str,
        claim: Claim | None = None,
    ) -> str:
        """End a block whose signed header verified: its signed rejection in the registry,
        where the gateway reads it, under a claim like a commit (so never over a commit)."""
        if claim is None:
            try:
                claim = await self._claim(header.block_id)
            except AlreadyCommitted:
                return await self._drop_duplicate(msg, header)
            except AlreadyClaimed as e:  # its holder decides; ask again after its lease
                await self._nak("claimed_elsewhere", msg, after_s=e.lease_left_s)
                log.info("block claimed elsewhere, redelivering later", holder=e.holder)
                return "claimed_elsewhere"
            except ValueError as e:
                return await self._drop_unverified(msg, "malformed", str(e))
        rejection = rejection_record(header, reason, detail, self.worker_id, self._signer)
        try:
            await self._registry.reject(claim, rejection)
        except ClaimLost:
            self._m.claims_lost.inc()
            await self._nak("claim_lost", msg)
            return "claim_lost"
        self._rows.free(header)
        log.warning("block rejected", reason=reason, detail=detail[:200])
        return await self._dead_letter(msg, reason, header.block_id, verified=True)

    async def _drop_unverified(self, msg: Msg, reason: str, detail: str) -> str:
        """End a delivery nobody can vouch for (a header or rows that do not verify): it
        names a request, but a forger may have named it, so no request hears of it."""
        log.warning("unverified block dropped", reason=reason, detail=detail[:200])
        return await self._dead_letter(msg, reason, "", verified=False)

    async def _dead_letter(self, msg: Msg, reason: str, block_id: str, *, verified: bool) -> str:
        """Terminate the delivery and keep a copy on the rejected stream for operators
        (no request waits on it: the gateway reads outcomes from the registry alone)."""
        self._m.rejected.labels(reason).inc()
        await msg.term()
        headers = {streams.REASON_HEADER: reason, streams.VERIFIED_HEADER: str(verified).lower()}
        if block_id:
            headers[streams.BLOCK_ID_HEADER] = block_id
        await self._nc.publish(streams.rejected_subject(reason), msg.data, headers=headers)
        return f"rejected:{reason}"
