"""Determinism gate: re-read committed blocks and say where a changed answer came from.

Every commit records the block's forward-state digest (the captured rows) and its output
digest (token ids and EOS positions). The rule is origin-aware:
  same output digest                                -> PASS (same_output)
  different output, different forward-state digest  -> PASS (upstream: the rows changed,
                                                       so the origin is before the readout)
  different output, same forward-state digest       -> FAIL (the readout itself is not
                                                       deterministic)

JetStream does not keep committed blocks: the blocks stream is a work queue (a block is
deleted once acked) and an object-store payload is deleted on commit. So the audit keeps
its own copies: `BlockTap` subscribes to the blocks subjects (a core subscription sees
every publish beside the stream) and fetches object payloads the moment a block arrives,
well before the worker's commit deletes them; a block on the `host` data plane has its
rows copied from its shared-memory region as it arrives (the tap on the same host), while
one on the `local` plane keeps them in the capture's process and one on the `ipc` plane in
its GPU memory, both out of an audit's reach.
Only blocks published while the tap listens can be audited.

Two checks per block: `reread` re-runs the stored block through a freshly loaded engine
(the rows are byte-identical, so only the readout can change the answer); with
`resubmit`, each prompt is sent again through the gateway, a new capture in a new cohort,
and the two commits are compared by the same rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import nats
import nats.errors
import nats.js.errors as js_errors
from nats.aio.msg import Msg
from nats.js.object_store import ObjectStore

from readout_svc.records import commit_record
from registry import CommitTimeout, Registry, RegistryError
from stateblock.engines import ReadoutEngine, lane_requests
from stateblock.model.rows import rows_view
from stateblock.model.shm import host_placement, open_region
from stateblock.protocol import envelope, locator, streams
from stateblock.protocol.keys import TrustStore
from stateblock.v1 import block_pb2 as block_pb
from stateblock.v1 import commit_pb2 as pb

AUDIT_WORKER_ID = "determinism-audit"
MAX_TAPPED = 4096  # a long listen must not hold every block ever published


class Outcome(StrEnum):
    SAME_OUTPUT = "same_output"
    UPSTREAM = "upstream"  # different output from different rows: not the readout's doing
    READOUT_NONDETERMINISM = "readout_nondeterminism"
    # different output, rows hashed with different algorithms: the digests cannot say
    # whether the rows were the same, so neither pass nor readout failure is shown
    INCOMPARABLE = "incomparable"


PASSING = frozenset({Outcome.SAME_OUTPUT, Outcome.UPSTREAM})


def classify(original: pb.Commit, rerun: pb.Commit) -> Outcome:
    """The origin-aware rule; pure, on the two commits' digests alone."""
    if original.output_digest == rerun.output_digest:
        return Outcome.SAME_OUTPUT
    if _algorithm(original) != _algorithm(rerun):
        return Outcome.INCOMPARABLE
    if original.forward_state_digest != rerun.forward_state_digest:
        return Outcome.UPSTREAM
    return Outcome.READOUT_NONDETERMINISM


def _algorithm(commit: pb.Commit) -> int:
    # a commit from before the field names no algorithm: its digest is SHA-256
    return commit.forward_state_algorithm or block_pb.DIGEST_ALGORITHM_SHA256


def reproducible(header: block_pb.StateBlockHeader) -> bool:
    """Greedy or seeded lanes only: unseeded sampling draws fresh noise by design."""
    return all(s.temperature == 0 or s.HasField("seed") for s in header.sampling)


def rerun_commit(block: envelope.VerifiedBlock, engine: ReadoutEngine) -> pb.Commit:
    """Read the stored block again and build the commit a worker would have written.

    The forward-state digest is recomputed from the rows actually read, not copied from
    the header, so the rule compares what the rerun saw.
    """
    results = engine.readout(lane_requests(block))
    commit = commit_record(block.header, results, AUDIT_WORKER_ID)
    commit.forward_state_digest = envelope.forward_state_digest(
        block.data, block.header.forward_state_algorithm
    )
    return commit


@dataclass(frozen=True)
class Check:
    kind: str  # "reread" | "resubmit"
    block_id: str
    other: str  # the block it was compared with ("reread": the same block)
    outcome: str  # an Outcome, or "skipped" / "unavailable"
    detail: str = ""
    output_digest: str = ""
    rerun_output_digest: str = ""
    forward_state_digest: str = ""
    rerun_forward_state_digest: str = ""


def check(kind: str, original: pb.Commit, rerun: pb.Commit, other: str = "") -> Check:
    return Check(
        kind=kind,
        block_id=original.block_id,
        other=other or original.block_id,
        outcome=str(classify(original, rerun)),
        output_digest=original.output_digest.hex(),
        rerun_output_digest=rerun.output_digest.hex(),
        forward_state_digest=original.forward_state_digest.hex(),
        rerun_forward_state_digest=rerun.forward_state_digest.hex(),
    )


def gate(checks: Sequence[Check], settings: dict | None = None) -> dict:
    """The report; FAIL on any readout nondeterminism, and when nothing could be checked."""
    found = [
        f"block {c.block_id}: {c.outcome} ({c.kind}): same forward-state digest "
        f"{c.forward_state_digest[:16]}, output {c.output_digest[:16]} != "
        f"{c.rerun_output_digest[:16]}"
        + (f" (compared with block {c.other})" if c.kind == "resubmit" else "")
        for c in checks
        if c.outcome == Outcome.READOUT_NONDETERMINISM
    ]
    if not any(c.outcome in PASSING | {Outcome.READOUT_NONDETERMINISM} for c in checks):
        found.append("no committed block was re-read: nothing shows the readout is deterministic")
    counts: dict[str, int] = {}
    for c in checks:
        counts[c.outcome] = counts.get(c.outcome, 0) + 1
    return {
        "gate": "FAIL" if found else "PASS",
        "blockers": found,
        "counts": counts,
        "checks": [asdict(c) for c in checks],
        "settings": settings or {},
    }


@dataclass(frozen=True)
class Tapped:
    block: block_pb.StateBlock
    payload: bytes | None  # the fetched object for an object-store payload
    error: str = ""  # why the payload could not be kept


class BlockTap:
    """Copies of the blocks published while it listens, by block id."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects
        self.blocks: dict[str, Tapped] = {}
        self.by_request: dict[str, str] = {}
        self.dropped = 0  # over MAX_TAPPED, or not a block at all

    @classmethod
    @asynccontextmanager
    async def open(cls, nc: nats.NATS) -> AsyncIterator[BlockTap]:
        tap = cls(await streams.payload_store(nc.jetstream()))
        sub = await nc.subscribe(streams.blocks_subject(">"), cb=tap._on_block)
        await nc.flush()  # the server has the subscription before anything is sent
        try:
            yield tap
        finally:
            await sub.unsubscribe()

    async def _on_block(self, msg: Msg) -> None:
        try:
            block = envelope.parse_block(msg.data)
        except envelope.BlockRejected:
            self.dropped += 1
            return
        block_id = block.header.block_id
        if len(self.blocks) >= MAX_TAPPED or block_id in self.blocks:
            self.dropped += block_id not in self.blocks
            return
        payload, error = None, ""
        if block.HasField("header") and locator.on_host(block.header):
            payload, error = region_rows(block.header)
        elif block.payload.WhichOneof("location") == "object_ref":
            try:  # fetched at once: the worker deletes the object once it commits
                payload = await streams.read_payload(self._objects, block.payload.object_ref.name)
            except (js_errors.NotFoundError, TimeoutError, nats.errors.Error) as e:
                error = f"payload object gone before the tap fetched it: {e!r}"
        self.blocks[block_id] = Tapped(block, payload, error)
        self.by_request[block.header.request_id] = block_id

    async def wait_for(self, request_ids: Sequence[str], timeout_s: float) -> None:
        """Until every request's block has been tapped (their replies can beat the callback)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(r not in self.by_request for r in request_ids) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def verified(self, block_id: str, trust: TrustStore) -> envelope.VerifiedBlock:
        """The stored block, verified as a worker would, except expiry: re-reading an
        expired block is what an audit does."""
        tapped = self.blocks[block_id]
        if tapped.error:
            raise LookupError(tapped.error)
        created = tapped.block.header.created_at.ToNanoseconds() / 1e9
        if locator.on_host(tapped.block.header):  # the rows the tap copied from the region
            header = envelope.trusted_header(tapped.block, trust, now=created, rows_apart=True)
            return envelope.HeaderVerified(header, tapped.payload or b"").confirm()
        return envelope.verify(tapped.block, trust, now=created, payload=tapped.payload)


def region_rows(header: block_pb.StateBlockHeader) -> tuple[bytes | None, str]:
    """A located block's rows, copied from its region at once (its worker unlinks the region
    on the block's outcome), or why they cannot be."""
    where = header.locator
    if where.transport == block_pb.TRANSPORT_LOCAL:
        return (
            None,
            "rows in the capture's slot pool (`local` data plane): no other process reads them",
        )
    if where.transport != block_pb.TRANSPORT_HOST:
        return (
            None,
            "rows in a capture's GPU arena (`ipc` data plane): the tap copies no GPU memory",
        )
    try:
        here = host_placement()
    except FileNotFoundError as e:
        return None, str(e)
    if where.placement != here:
        return None, f"rows in another host's shared memory (placement {where.placement})"
    try:
        rows = open_region(where.region, header.layout)
    except ValueError as e:
        return None, f"region not the layout's: {e}"
    if rows is None:
        return None, f"region {where.region} gone before the tap read it"
    return bytes(rows_view(rows)), ""


async def committed(registry: Registry, block_id: str, timeout_s: float) -> pb.Commit | str:
    """The block's commit, or why there is none (rejected or still queued, which is not a
    determinism question)."""
    try:
        return await registry.watch_commit(block_id, timeout_s)
    except (CommitTimeout, RegistryError) as e:
        return f"no commit: {e}"


def _same_pieces(header: block_pb.StateBlockHeader, engine: ReadoutEngine) -> bool:
    want = engine.identity
    return (
        header.model,
        header.base_model_digest,
        header.lm_head_digest,
        header.decoder_digest,
    ) == (
        want.model,
        want.base_model_digest,
        want.lm_head_digest,
        want.decoder_digest,
    )


async def reread(
    tap: BlockTap, commit: pb.Commit, engine: ReadoutEngine, trust: TrustStore
) -> Check:
    """Re-run the stored block of `commit` through `engine` and classify."""
    block_id = commit.block_id

    def not_checked(outcome: str, why: str) -> Check:
        return Check("reread", block_id, block_id, outcome, why)

    try:
        block = tap.verified(block_id, trust)
    except (LookupError, envelope.BlockRejected, ValueError) as e:
        return not_checked("unavailable", f"stored block cannot be re-read: {e}")
    if not _same_pieces(block.header, engine):  # a worker would not have read it either
        return not_checked("unavailable", "captured for other model pieces than this engine's")
    if not reproducible(block.header):
        return not_checked("skipped", "unseeded sampling draws fresh noise by design")
    rerun = await asyncio.to_thread(rerun_commit, block, engine)
    return check("reread", commit, rerun)


async def _generate(stub, model: str, prompt: str, depth: int, timeout_s: float) -> str:
    from stateblock.v1 import gateway_pb2

    req = gateway_pb2.GenerateRequest(model=model, prompt=prompt, max_tokens=depth)
    return (await stub.Generate(req, timeout=timeout_s)).request_id


async def send_prompts(
    grpc_target: str, model: str, prompts: Sequence[str], depth: int, timeout_s: float
) -> list[str]:
    """All prompts at once, so they share cohorts as real traffic would; request ids back."""
    import grpc

    from stateblock.v1 import gateway_pb2_grpc

    async with grpc.aio.insecure_channel(grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return list(
            await asyncio.gather(*(_generate(stub, model, p, depth, timeout_s) for p in prompts))
        )


async def determinism_audit(
    nc: nats.NATS,
    engine: ReadoutEngine,
    trust: TrustStore,
    *,
    grpc_target: str | None = None,
    model: str = "",
    prompts: Sequence[str] = (),
    depth: int = 256,
    resubmit: bool = True,
    listen_s: float = 0.0,
    timeout_s: float = 60.0,
) -> dict:
    """Tap the blocks, drive `prompts` through the gateway (if given) and/or listen to other
    traffic for `listen_s`, then check every tapped block."""
    registry = await Registry.open(nc.jetstream())
    async with BlockTap.open(nc) as tap:
        first: list[str] = []
        second: list[str] = []
        if grpc_target and prompts:
            first = await send_prompts(grpc_target, model, prompts, depth, timeout_s)
            if resubmit:
                second = await send_prompts(grpc_target, model, prompts, depth, timeout_s)
        await asyncio.sleep(listen_s)
        await tap.wait_for(first + second, timeout_s)
        tapped = list(tap.blocks)
        # Waited for together: a block that was rejected never commits, and waiting them
        # out one by one would cost the whole timeout each.
        waited = await asyncio.gather(*(committed(registry, b, timeout_s) for b in tapped))
        checks: list[Check] = []
        commits: dict[str, pb.Commit] = {}
        for block_id, got in zip(tapped, waited, strict=True):
            if isinstance(got, str):
                checks.append(Check("reread", block_id, block_id, "unavailable", got))
                continue
            commits[block_id] = got
            checks.append(await reread(tap, got, engine, trust))
        for a, b in zip(first, second, strict=False):  # second is empty without resubmit
            ida, idb = tap.by_request.get(a), tap.by_request.get(b)
            if ida in commits and idb in commits:
                checks.append(check("resubmit", commits[ida], commits[idb], other=idb))
            else:
                checks.append(Check("resubmit", ida or a, idb or b, "unavailable", "no commit"))
    return gate(
        checks,
        {
            "engine": engine.name,
            "prompts": len(prompts),
            "depth": depth,
            "resubmit": resubmit,
            "listen_s": listen_s,
            "blocks_tapped": len(tapped),
            "blocks_dropped": tap.dropped,
        },
    )


async def embedded_determinism(
    *,
    data_dir: Path,
    base_dir: Path,
    decoder_dir: Path,
    engine_name: str,
    prompts: Sequence[str],
    depth: int,
    resubmit: bool = True,
    workers: int = 2,
    device: str = "cpu",
) -> dict:
    """The embedded default with its own nats-server, driven with `prompts`; the rerun
    engine is loaded apart from the one the workers use."""
    from stateblock.app.stack import UpConfig, running_stack
    from stateblock.engines import create_engine
    from stateblock.model.loading import load_serving_model
    from stateblock.runtime import DEFAULT_MODEL_NAME

    config = UpConfig.on_free_ports(
        data_dir,
        workers=workers,
        base_dir=base_dir,
        decoder_dir=decoder_dir,
        engine=engine_name,
        data_plane="bus",  # the audit re-reads the rows each block carried
    )
    model = await asyncio.to_thread(
        load_serving_model, DEFAULT_MODEL_NAME, base_dir, decoder_dir, device=device
    )
    engine = create_engine(engine_name, model, device)
    async with running_stack(config) as urls:
        trust = TrustStore.from_dir(data_dir / "keys")
        nc = await nats.connect(urls.nats_admin, name="stateblock-audit")
        try:
            return await determinism_audit(
                nc,
                engine,
                trust,
                grpc_target=urls.grpc,
                model=config.model_name,
                prompts=prompts,
                depth=depth,
                resubmit=resubmit,
            )
        finally:
            await nc.drain()


async def external_determinism(
    nats_url: str,
    *,
    base_dir: Path,
    decoder_dir: Path,
    engine_name: str,
    trusted_keys: Path,
    grpc_target: str | None,
    prompts: Sequence[str],
    depth: int,
    resubmit: bool = True,
    listen_s: float = 0.0,
    device: str = "cpu",
    model_name: str | None = None,
) -> dict:
    """A running deployment: tap its NATS, optionally drive its gateway, re-read locally."""
    from stateblock.engines import create_engine
    from stateblock.model.loading import load_serving_model
    from stateblock.runtime import DEFAULT_MODEL_NAME

    name = model_name or DEFAULT_MODEL_NAME
    model = await asyncio.to_thread(load_serving_model, name, base_dir, decoder_dir, device=device)
    engine = create_engine(engine_name, model, device)
    trust = TrustStore.from_dir(trusted_keys)
    if not len(trust):
        raise ValueError(f"no trusted public keys (*.pub) in {trusted_keys}")
    nc = await nats.connect(nats_url, name="stateblock-audit")
    try:
        return await determinism_audit(
            nc,
            engine,
            trust,
            grpc_target=grpc_target,
            model=name,
            prompts=prompts,
            depth=depth,
            resubmit=resubmit,
            listen_s=listen_s,
        )
    finally:
        await nc.drain()
