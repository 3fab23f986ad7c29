"""The local data plane against a real nats-server: headers on the placement's subject, the
rows in this process's slot pool, checked by their checksum on their device; slots freed on
commit, rejection and expiry, a worker that dies holding one leaks nothing, a reused slot is
caught, and a full pool fails the capture with nothing published."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import nats
import openai
import pytest
import torch
from prometheus_client import CollectorRegistry

from bench.procs import ProcStack, ProcStackConfig
from capture_svc.config import CaptureConfig
from capture_svc.dataplane import HostPlane, LocalPlane, Sealer
from capture_svc.publisher import BlockPublisher
from capture_svc.server import running_capture, status_of
from capture_svc.service import CaptureUnavailable
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from registry import Registry
from stateblock.app.plan import IN_PROCESS
from stateblock.app.stack import StackThread, UpConfig
from stateblock.engines import LaneRequest
from stateblock.model.rows import rows_view
from stateblock.model.shm import SHM_DIR, HostRegions, host_placement, open_region, region_name
from stateblock.model.slots import SlotPool, SlotPoolFull, rows_digest
from stateblock.protocol import envelope, layouts, locator, outcomes, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE, ConfigError
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import capture_pb2, commit_pb2
from tests.helpers import until
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST

SIGNER = Signer.generate()


def captured(serving_model, seed: int, rows_per_lane=(6,)) -> tuple[pb.Layout, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(rows_per_lane), serving_model.hidden_size, generator=gen)
    layout = layouts.make_layout(
        f"req-{seed}", rows_per_lane, [16] * len(rows_per_lane),
        hidden_size=serving_model.hidden_size, dtype=rows.dtype,
    )  # fmt: skip
    return layout, rows


async def place(
    pool: SlotPool,
    serving_model,
    layout,
    rows,
    ttl_s=60.0,
    algorithm=pb.DIGEST_ALGORITHM_SLOT_CHECKSUM,  # what rows on an accelerator carry
) -> pb.StateBlockHeader:
    """What the local plane does before it publishes: a slot, the digest, the header."""
    block_id, now = f"block-{layout.lanes[0].request_id}-{time.time_ns()}", time.time()
    slot = await pool.reserve(block_id, now + ttl_s, 1.0)
    header = envelope.signed_header(
        layout, rows_digest(rows, algorithm), algorithm,
        request_id=layout.lanes[0].request_id, identity=serving_model.identity,
        sampling=[pb.SamplingParams() for _ in layout.lanes], signer=SIGNER, ttl_s=ttl_s,
        block_id=block_id, now=now,
        locator=locator.slot_locator(locator.LOCAL, pool.instance_id, slot),
    )  # fmt: skip
    pool.fill(slot, block_id, rows)
    return header


async def publish(nc, header: pb.StateBlockHeader) -> None:
    subject = streams.placement_subject(MODEL, header.locator.placement)
    data = envelope.serialize_block(pb.StateBlock(header=header))
    await nc.jetstream().publish(subject, data, headers={"Nats-Msg-Id": header.block_id})


def config(**kw) -> ReadoutServiceConfig:
    return ReadoutServiceConfig(
        nats_url="unused", workers=2, fetch_timeout_s=0.2, retry_delay_s=0.2,
        data_plane="local", **kw,
    )  # fmt: skip


@asynccontextmanager
async def readout(nc, engine, pool, **kw):
    metrics = CollectorRegistry()
    async with running_readout(
        config(**kw), nc=nc, engine=engine, trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER, metrics=metrics, slots=pool,
    ) as running:  # fmt: skip
        yield running, metrics


async def outcome(nc, block_id: str):
    registry = await Registry.open(nc.jetstream())
    for _ in range(800):
        entry = await registry.get(block_id)
        if entry is not None and entry.state != commit_pb2.CLAIM_STATE_CLAIMED:
            return entry.state, outcomes.outcome_of(entry, READOUT_TRUST, block_id)
        await asyncio.sleep(0.025)
    raise AssertionError(f"no outcome for {block_id}")


@pytest.mark.parametrize(
    "algorithm", [pb.DIGEST_ALGORITHM_SLOT_CHECKSUM, pb.DIGEST_ALGORITHM_BLAKE3],
    ids=["slot_checksum", "blake3"],
)  # fmt: skip
async def test_a_slot_block_is_read_from_its_slot_and_its_slot_freed(
    nc, engine, serving_model, algorithm
):
    pool = SlotPool(4)
    async with readout(nc, engine, pool) as (_, metrics):
        layout, rows = captured(serving_model, 1, (5, 9))
        header = await place(pool, serving_model, layout, rows, algorithm=algorithm)
        await publish(nc, header)
        state, commit = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_COMMITTED
        lanes = [rows[:5], rows[5:]]
        expected = engine.readout([LaneRequest(rows=r, depth=16) for r in lanes])
        assert [list(a.token_ids) for a in commit.lanes] == [list(e.token_ids) for e in expected]
        assert commit.forward_state_algorithm == algorithm
        assert commit.forward_state_digest == rows_digest(rows, algorithm)
        await until(lambda: pool.held() == 0)
        digests = "stateblock_readout_stage_seconds_count"
        assert metrics.get_sample_value(digests, {"stage": "digest", "route": "cohort"}) == 1


async def test_a_bus_block_never_reaches_the_placement_s_workers(nc, engine, serving_model):
    """The placement's consumer filters its own subject: a bus block waits for the bus's."""
    pool = SlotPool(1)
    async with readout(nc, engine, pool):
        js = nc.jetstream()
        await js.publish(streams.blocks_subject(MODEL), b"not read here")
        await asyncio.sleep(0.5)
        durable = streams.placement_durable(MODEL, pool.instance_id)
        info = await js.consumer_info(streams.BLOCKS_STREAM, durable)
        assert info.delivered.stream_seq == 0
        assert (await js.stream_info(streams.BLOCKS_STREAM)).state.messages == 1


async def test_a_reused_slot_is_caught_by_the_signed_checksum(nc, engine, serving_model):
    """Block A's slot is reused by block B before A is read: A's delivery finds B's rows,
    whose checksum is not the one A's header signed. A ends rejected as `rows_missing` (its
    rows are lost, not forged: its request is told and captured again), B's slot stays B's,
    and B is read as usual."""
    pool = SlotPool(1)
    layout_a, rows_a = captured(serving_model, 2)
    stale = await place(pool, serving_model, layout_a, rows_a)
    assert pool.free(stale.locator.slot, stale.block_id)
    layout_b, rows_b = captured(serving_model, 3)
    fresh = await place(pool, serving_model, layout_b, rows_b)
    assert fresh.locator.slot == stale.locator.slot
    async with readout(nc, engine, pool) as (_, metrics):
        await publish(nc, stale)
        state, rejection = await outcome(nc, stale.block_id)
        assert state == commit_pb2.CLAIM_STATE_REJECTED
        assert rejection.reason == "rows_missing"
        assert pool.held() == 1 and pool.rows(fresh.locator.slot)[0] == fresh.block_id
        await publish(nc, fresh)
        state, _ = await outcome(nc, fresh.block_id)
        assert state == commit_pb2.CLAIM_STATE_COMMITTED
        await until(lambda: pool.held() == 0)
        assert metrics.get_sample_value("stateblock_blocks_committed_total") == 1


async def test_rows_whose_slot_is_free_end_rows_missing(nc, engine, serving_model):
    pool = SlotPool(2)
    header = await place(pool, serving_model, *captured(serving_model, 4))
    pool.free(header.locator.slot, header.block_id)
    async with readout(nc, engine, pool):
        await publish(nc, header)
        state, rejection = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_REJECTED and rejection.reason == "rows_missing"


async def test_an_expired_block_is_rejected_and_its_slot_was_already_back(
    nc, engine, serving_model
):
    pool = SlotPool(1)
    header = await place(pool, serving_model, *captured(serving_model, 5), ttl_s=0.2)
    await asyncio.sleep(0.3)
    assert pool.held() == 0  # expiry alone gives it back, read or not
    async with readout(nc, engine, pool):
        await publish(nc, header)
        state, rejection = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_REJECTED and rejection.reason == "expired"


class StuckEngine:
    """The engine, its first readout held until `release` (a worker dies holding it)."""

    def __init__(self, engine) -> None:
        self.name, self.identity, self._engine = engine.name, engine.identity, engine
        self.started, self.release = threading.Event(), threading.Event()

    def readout(self, lanes):
        self.started.set()
        self.release.wait(30)
        return self._engine.readout(lanes)

    def warm_up(self) -> None:
        pass


async def test_a_worker_that_dies_holding_a_slot_leaks_nothing(nc, engine, serving_model):
    """A process's workers are cancelled mid-readout (their claim and the delivery left
    behind, no ack): the block comes back after ack_wait, another worker takes the lapsed
    claim over, commits, and the slot goes back."""
    pool = SlotPool(1)
    stuck = StuckEngine(engine)
    timing = {"lease_s": 0.6, "ack_wait_s": 1.0, "grace_s": 0.05}
    header = await place(pool, serving_model, *captured(serving_model, 6))
    async with readout(nc, stuck, pool, **timing):
        await publish(nc, header)
        assert await asyncio.to_thread(stuck.started.wait, 20)
        # leaving the context stops the workers: the one in the readout is cancelled after
        # grace_s; the engine's thread is let go later, only so the process's threads end
        asyncio.get_running_loop().call_later(0.5, stuck.release.set)
    registry = await Registry.open(nc.jetstream())
    assert (await registry.get(header.block_id)).state == commit_pb2.CLAIM_STATE_CLAIMED
    assert pool.held() == 1
    async with readout(nc, engine, pool, **timing) as (_, metrics):
        state, _ = await outcome(nc, header.block_id)
        assert state == commit_pb2.CLAIM_STATE_COMMITTED
        await until(lambda: pool.held() == 0)
        assert metrics.get_sample_value("stateblock_blocks_committed_total") == 1


async def test_a_full_pool_fails_the_capture_with_nothing_published(nc, serving_model):
    """Every slot held: the capture waits its bound, then fails; no header went out and the
    slots are as they were. A slot freed while it waits lets it through, and the wait is
    its `reserve` stage."""
    pool = SlotPool(1)
    holder = await place(pool, serving_model, *captured(serving_model, 7))
    js = nc.jetstream()
    await streams.ensure_streams(js)
    publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5.0)
    plane = LocalPlane(publisher, Sealer(SIGNER, serving_model.identity, 60.0), pool, wait_s=0.2)
    stage = _Stage()
    layout, rows = captured(serving_model, 8)
    with pytest.raises(SlotPoolFull):
        await plane.deliver(layout, rows, request_id="req-8", sampling=[pb.SamplingParams()],
                            stage=stage)  # fmt: skip
    assert (await js.stream_info(streams.BLOCKS_STREAM)).state.messages == 0
    assert pool.held() == 1 and pool.rows(0)[0] == holder.block_id
    slow = LocalPlane(publisher, Sealer(SIGNER, serving_model.identity, 60.0), pool, wait_s=10)
    waiting = asyncio.ensure_future(
        slow.deliver(
            layout, rows, request_id="req-8", sampling=[pb.SamplingParams()], stage=stage
        )  # fmt: skip
    )
    await asyncio.sleep(0.1)
    assert not waiting.done()
    pool.free(0, holder.block_id)
    delivered = await asyncio.wait_for(waiting, 10)
    assert pool.rows(0)[0] == delivered.block_id
    assert (await js.stream_info(streams.BLOCKS_STREAM)).state.messages == 1
    assert stage.seen["reserve"][0] >= 0.2  # the failed one waited its bound
    assert stage.seen["reserve"][1] >= 0.1  # and this one until the slot was freed
    assert len(stage.seen["sign"]) == len(stage.seen["publish"]) == 1


async def test_the_host_plane_signs_the_rows_it_wrote_and_times_each_part(
    nc, serving_model, tmp_path
):
    """The host plane's region holds the rows, written piece by piece, and the header signs
    their digest; the copy, the hash and the write are timed apart, inside `sign`."""
    regions = HostRegions(2, 60.0, shm_dir=tmp_path)
    await streams.ensure_streams(nc.jetstream())
    publisher = await BlockPublisher.open(nc, model=MODEL, timeout_s=5.0)
    plane = HostPlane(publisher, Sealer(SIGNER, serving_model.identity, 60.0), regions, wait_s=1)
    stage = _Stage()
    layout, rows = captured(serving_model, 9, rows_per_lane=(6, 3))
    delivered = await plane.deliver(
        layout, rows, request_id="req-9", sampling=[pb.SamplingParams()] * 2, stage=stage
    )
    name = region_name(delivered.block_id)
    assert torch.equal(open_region(name, layout, tmp_path), rows)
    msg = await nc.jetstream().get_last_msg(
        streams.BLOCKS_STREAM, streams.placement_subject(MODEL, regions.placement)
    )
    header = pb.StateBlock.FromString(msg.data).header
    assert header.block_id == delivered.block_id and locator.on_host(header)
    assert header.forward_state_digest == envelope.forward_state_digest(
        rows_view(rows), header.forward_state_algorithm
    )
    parts = [stage.seen[name][0] for name in ("rows_copy", "rows_digest", "rows_write")]
    assert all(seconds >= 0 for seconds in parts) and sum(parts) <= stage.seen["sign"][0]


class _Stage:
    """The capture's stage histogram, keeping each stage's observations."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    def labels(self, name: str):
        return SimpleNamespace(observe=self.seen.setdefault(name, []).append)


async def test_the_local_plane_needs_its_pool_and_the_bus_none(nc, engine):
    with pytest.raises(ConfigError, match="slot pool"):
        async with running_readout(
            config(), nc=nc, engine=engine, trust=TrustStore([SIGNER.public_key]),
            signer=READOUT_SIGNER, metrics=CollectorRegistry(),
        ):  # fmt: skip
            pass


# --- `stateblock up`'s default: the whole request path on the local data plane -------------

PROMPTS = [f"copy: {'abcdefgh'[i % 8] * (1 + i % 5)}{i}" for i in range(8)]


@pytest.fixture(scope="module")
def local_stack(decoder_dir, tmp_path_factory):
    config = UpConfig(
        data_dir=tmp_path_factory.mktemp("local"), http_port=0, grpc_port=0, workers=2,
        decoder_dir=decoder_dir, request_timeout_s=30.0,
    )  # fmt: skip
    assert config.data_plane == "local"  # `stateblock up`'s default
    runner = StackThread(config)
    runner.start()
    yield runner
    runner.stop()


def answers(url: str) -> list[list[str]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = []
    for i, prompt in enumerate(PROMPTS):
        extra = {"n": 2} if i % 3 == 0 else {}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8 + 4 * i, temperature=0, **extra
        )
        out.append([c.text for c in r.choices])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=12, temperature=0)
    return [*out, [c.text for c in r.choices]]


def test_local_answers_are_the_bus_answers(stack, local_stack):
    """The same greedy requests through `stateblock up` on each data plane: identical
    answers; the local stack's blocks went over its placement's consumer alone, and every
    slot came back."""
    assert answers(local_stack.urls.http) == answers(stack.urls.http)

    async def consumers(url: str) -> dict[str, int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            infos = await js.consumers_info(streams.BLOCKS_STREAM)
            return {i.name: i.delivered.stream_seq for i in infos}
        finally:
            await nc.close()

    seen = asyncio.run(consumers(local_stack.urls.nats_admin))
    (name,) = seen
    assert name.startswith(streams.readout_durable(MODEL) + "-") and seen[name] >= len(PROMPTS)
    assert held_slots(f"{local_stack.urls.http}/metrics") == ["stateblock_capture_slots_held 0.0"]


def held_slots(metrics_url: str) -> list[str]:
    text = httpx.get(metrics_url).text
    return [line for line in text.splitlines() if line.startswith("stateblock_capture_slots_held")]


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_host_answers_are_the_bus_answers_across_processes(stack, decoder_dir, tmp_path):
    """The deployed shape, a process per service, on the host data plane: the rows in
    /dev/shm, the headers on this host's placement subject; the answers are the bus's, and
    every region was unlinked by its reader."""
    procs = ProcStack(
        ProcStackConfig(
            data_dir=tmp_path / "procs", model_name=MODEL, base_dir=REFERENCE_BASE,
            decoder_dir=decoder_dir, device="cpu", capture_dtype="float32",
            engine="reference", ready_timeout_s=180.0,
            extra_env={"STATEBLOCK_DATA_PLANE": "host"},
        )
    )  # fmt: skip
    url = procs.start()
    try:
        assert answers(url) == answers(stack.urls.http)

        async def delivered() -> int:
            nc = await nats.connect(procs.nats_url)
            try:
                durable = streams.placement_durable(MODEL, host_placement())
                info = await nc.jetstream().consumer_info(streams.BLOCKS_STREAM, durable)
                return info.delivered.stream_seq
            finally:
                await nc.close()

        assert asyncio.run(delivered()) >= len(PROMPTS)
        assert held_slots(procs.metrics_urls[0]) == ["stateblock_capture_slots_held 0.0"]
    finally:
        procs.stop()


async def test_a_capture_with_every_slot_held_is_unavailable_and_leaves_nothing(
    nats_url, serving_model
):
    """Through the capture service: the one slot held by an unread block, the next capture
    waits its publish bound and fails UNAVAILABLE, naming the full pool; no second header
    went out and no plan or slot of it stayed."""
    nc = await nats.connect(nats_url)
    config = CaptureConfig(
        nats_url=nats_url, port=0, data_plane="local", data_plane_slots=1,
        publish_timeout_s=0.3,
    )  # fmt: skip
    try:
        async with running_capture(
            config, nc=nc, model=serving_model, signer=SIGNER, metrics=CollectorRegistry()
        ) as running:
            first = await running.service.capture("req-a", MODEL, [lane("copy: a", 4)])
            assert running.slots.rows(0)[0] == first.block_id
            with pytest.raises(CaptureUnavailable, match="slots hold blocks") as info:
                await running.service.capture("req-b", MODEL, [lane("copy: b", 4)])
            assert status_of(info.value) == grpc.StatusCode.UNAVAILABLE
            stream = await nc.jetstream().stream_info(streams.BLOCKS_STREAM)
            assert stream.state.messages == 1 and running.plans.active() == 0
            assert running.slots.held() == 1 and running.slots.rows(0)[0] == first.block_id
    finally:
        await nc.close()


def lane(prompt: str, max_tokens: int) -> capture_pb2.CaptureLane:
    return capture_pb2.CaptureLane(prompt=prompt, max_tokens=max_tokens)


def test_the_bench_runs_stateblock_up_as_one_process(stack, decoder_dir, tmp_path):
    """The load bench's in-process placement: one `stateblock up` process started from the
    bench's plan (its settings through the environment `up` reads): the bus's answers from
    the local plane, the services' stages on its one /metrics, its nats-server among the
    processes the bench measures, and nothing left when it stops."""
    procs = ProcStack(
        ProcStackConfig(
            data_dir=tmp_path / "up", model_name=MODEL, base_dir=REFERENCE_BASE,
            decoder_dir=decoder_dir, device="cpu", capture_dtype="float32",
            engine="reference", ready_timeout_s=180.0, placement=IN_PROCESS,
            extra_env={"STATEBLOCK_CAPTURE_COHORT_LANES": "16"},
        )
    )  # fmt: skip
    url = procs.start()
    try:
        assert answers(url) == answers(stack.urls.http)
        stages = procs.scrape()
        assert stages[("stateblock_capture_stage_seconds_count", "forward")] >= len(PROMPTS)
        assert stages[("stateblock_readout_stage_seconds_count", "readout")] >= 1
        assert held_slots(procs.metrics_urls[0]) == ["stateblock_capture_slots_held 0.0"]
        pids = procs.pids()
        assert set(pids) == {"stack", "nats"}
    finally:
        procs.stop()
    assert procs.pids() == {}
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
