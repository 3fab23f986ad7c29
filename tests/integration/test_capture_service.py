"""The capture registry's checks and counters, the batcher, and the capture service on NATS."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import nats
import pytest
import torch
from nats.js.api import StorageType
from prometheus_client import CollectorRegistry

from capture_svc import service as capture_service_module
from capture_svc.batcher import ForwardBatcher, Pending, bucket_width
from capture_svc.config import CaptureConfig, CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import (
    CaptureIntegrityError,
    CohortStamp,
    DoubleConsume,
    PlanTable,
    PlanTableMetrics,
    Slot,
)
from capture_svc.server import running_capture
from capture_svc.service import CaptureFailed, InvalidCapture
from stateblock.model.capture import UNMASKED_SDPA
from stateblock.model.rows import block_lanes
from stateblock.protocol import envelope, layouts, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.sampling import Limits, sampling_params
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import ConfigError
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import capture_pb2

D = 8
MODE = pb.CAPTURE_MODE_FINAL_HIDDEN
COUNTERS = (
    "plans_registered", "records", "consumed", "cross_request_events", "identity_mismatch",
    "lane_length_mismatch", "row_count_mismatch", "layout_digest_mismatch", "mode_mismatch",
    "double_consume", "unplanned_records", "expired_plans",
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lane(
    prompt: str | None = None,
    messages: tuple[tuple[str, str], ...] | None = None,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> capture_pb2.CaptureLane:
    """One CaptureLane as the gateway sends it."""
    out = capture_pb2.CaptureLane(
        sampling=sampling_params(temperature, seed), max_tokens=max_tokens
    )
    if messages is not None:
        out.chat.SetInParent()
        out.chat.messages.extend(capture_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    else:
        out.prompt = prompt or ""
    return out


@pytest.fixture
def metrics() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(metrics, clock) -> PlanTable:
    return PlanTable(PlanTableMetrics(metrics), plan_ttl_s=10, clock=clock)


def count(metrics: CollectorRegistry, name: str) -> float:
    suffix = "" if name == "active_plans" else "_total"
    return metrics.get_sample_value(f"stateblock_capture_{name}{suffix}") or 0.0


def plan(reg: PlanTable, rid: str, lengths=(3, 5)):
    layout = layouts.make_layout(
        rid, lengths, [4] * len(lengths), hidden_size=D, dtype=torch.float32
    )
    return reg.register(rid, layout)


def stamp(p, rows_at=(0, 1), token=None, mode=MODE) -> CohortStamp:
    slots = tuple(
        Slot(p.request_id, token or p.token, lane, row) for lane, row in enumerate(rows_at)
    )
    return CohortStamp(slots, mode)


def test_exactly_the_thirteen_metric_names(metrics, reg):
    names = {m.name for m in metrics.collect()}
    assert names == {f"stateblock_capture_{c}" for c in COUNTERS} | {
        "stateblock_capture_active_plans"
    }


def test_register_record_consume_exactly_once(metrics, reg):
    p = plan(reg, "r1")
    rows = torch.randn(2, 6, D)  # (B, P, d): padded cohort rows
    reg.record(stamp(p), rows, [3, 5])
    assert count(metrics, "active_plans") == 1
    out = reg.consume("r1", p.layout_digest)
    assert torch.equal(out, torch.cat([rows[0, :3], rows[1, :5]]))
    assert count(metrics, "consumed") == 1 and count(metrics, "active_plans") == 0
    with pytest.raises(DoubleConsume):
        reg.consume("r1", p.layout_digest)
    assert count(metrics, "double_consume") == 1
    assert count(metrics, "plans_registered") == 1 and count(metrics, "records") == 1


def test_cohort_rows_go_to_their_own_requests(reg):
    a, b = plan(reg, "a", (2,)), plan(reg, "b", (4, 1))
    rows = torch.arange(3 * 5 * D, dtype=torch.float32).view(3, 5, D)
    slots = (Slot("b", b.token, 0, 0), Slot("a", a.token, 0, 1), Slot("b", b.token, 1, 2))
    reg.record(CohortStamp(slots, MODE), rows, [4, 2, 1])
    assert torch.equal(reg.consume("a", a.layout_digest), rows[1, :2])
    assert torch.equal(reg.consume("b", b.layout_digest), torch.cat([rows[0, :4], rows[2, :1]]))


@pytest.mark.parametrize(
    ("kind", "record"),
    [
        ("lane_length_mismatch", lambda r, p: r.record(stamp(p), torch.randn(2, 6, D), [3, 4])),
        ("identity_mismatch", lambda r, p: r.record(stamp(p, token="stale"), torch.randn(2, 6, D), [3, 5])),
        ("mode_mismatch", lambda r, p: r.record(stamp(p, mode=99), torch.randn(2, 6, D), [3, 5])),
        ("cross_request_events", lambda r, p: r.record(stamp(p, rows_at=(0, 0)), torch.randn(2, 6, D), [3, 5])),
        ("layout_digest_mismatch", lambda r, p: r.record(stamp(p), torch.randn(2, 6, D + 1), [3, 5])),
    ],
)  # fmt: skip
def test_each_failed_check_is_counted_and_poisons_only_its_request(metrics, reg, kind, record):
    p = plan(reg, "bad")
    other = plan(reg, "good", (2,))
    record(reg, p)
    reg.record(CohortStamp((Slot("good", other.token, 0, 0),), MODE), torch.randn(1, 4, D), [2])
    with pytest.raises(CaptureIntegrityError) as info:
        reg.consume("bad", p.layout_digest)
    assert info.value.kind == kind
    assert count(metrics, kind) == 1
    assert reg.consume("good", other.layout_digest).shape == (2, D)


def test_second_record_and_unplanned_and_expiry(metrics, reg, clock):
    p = plan(reg, "r")
    reg.record(stamp(p), torch.randn(2, 6, D), [3, 5])
    reg.record(stamp(p), torch.randn(2, 6, D), [3, 5])  # a second forward into the same slot
    assert count(metrics, "cross_request_events") == 1
    reg.record(CohortStamp((Slot("ghost", "t", 0, 0),), MODE), torch.randn(1, 4, D), [2])
    assert count(metrics, "unplanned_records") == 1
    plan(reg, "late")
    clock.now += 11
    assert reg.sweep() == 2 and count(metrics, "expired_plans") == 2
    assert count(metrics, "active_plans") == 0


def test_consume_checks_the_layout_digest(metrics, reg):
    p = plan(reg, "r")
    reg.record(stamp(p), torch.randn(2, 6, D), [3, 5])
    with pytest.raises(CaptureIntegrityError):
        reg.consume("r", b"\x00" * 32)
    assert count(metrics, "layout_digest_mismatch") == 1


def test_bucket_width_is_the_smallest_power_of_two_or_one_and_a_half_times_one():
    lengths = (1, 15, 16, 17, 24, 25, 33, 512, 513, 768, 769, 4096)
    assert [bucket_width(n) for n in lengths] == [
        16, 16, 16, 24, 24, 32, 48, 512, 768, 768, 1024, 4096
    ]  # fmt: skip
    for n in range(17, 5000):
        assert bucket_width(n) >= n and 3 * (bucket_width(n) - n) < bucket_width(n), n


async def test_batched_cohort_rows_equal_each_request_alone(serving_model, metrics, reg):
    tok = serving_model.tokenizer
    prompts = ["copy: a", "sort: zyxwvu", "reverse: hello there", "add: 12+34", "count: 1 5"]
    forward = CohortForward(serving_model.model, reg, pad_id=tok.pad_token_id, capture_mode=MODE)

    def run(batch: list[str], tag: str) -> list[torch.Tensor]:
        pending = []
        for p in batch:
            ids = tok(p)["input_ids"]
            layout = layouts.make_layout(
                f"{tag}{p}", [len(ids)], [4], hidden_size=serving_model.hidden_size,
                dtype=torch.float32,
            )  # fmt: skip
            pending.append(Pending(reg.register(f"{tag}{p}", layout), [ids], None))
        forward(pending)
        return [reg.consume(q.plan.request_id, q.plan.layout_digest) for q in pending]

    alone = [run([p], "alone")[0] for p in prompts]
    together = run(prompts, "together")
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()


async def test_batcher_groups_concurrent_requests(serving_model, metrics, reg):
    tok = serving_model.tokenizer
    sizes = []
    forward = CohortForward(serving_model.model, reg, pad_id=tok.pad_token_id, capture_mode=MODE)

    async def submit(batcher, rid: str, prompt: str):
        ids = tok(prompt)["input_ids"]
        layout = layouts.make_layout(
            rid, [len(ids)], [4], hidden_size=serving_model.hidden_size, dtype=torch.float32
        )
        p = reg.register(rid, layout)
        await batcher.submit(p, [ids])
        return reg.consume(rid, p.layout_digest)

    with ThreadPoolExecutor(1) as pool:
        async with ForwardBatcher(
            forward, pool, window_s=0.05, max_lanes=4, on_cohort=sizes.append
        ) as batcher:
            outs = await asyncio.gather(*(submit(batcher, f"r{i}", f"copy: {i}") for i in range(6)))
    assert len(outs) == 6 and sorted(sizes) == [2, 4]  # K_max = 4 lanes per forward


@pytest.mark.parametrize(
    ("cohort", "expected"),
    [
        (CohortLimits(lanes=8, tokens=1 << 20), [6]),  # lanes from many requests share one
        (CohortLimits(lanes=4, tokens=1 << 20), [2, 4]),
        (CohortLimits(lanes=8, tokens=3 * 16), [3, 3]),  # 3 lanes x 16 wide
        (CohortLimits(lanes=8, tokens=1), [1] * 6),  # one request always fits
    ],
)
async def test_cohorts_sized_by_lanes_and_tokens(serving_model, cohort, expected):
    """One forward carries lanes of several requests up to the cohort's lanes and padded
    tokens; the per-request lane limit stays the request's own."""
    tok = serving_model.tokenizer
    reg = PlanTable(PlanTableMetrics(CollectorRegistry()))
    forward = CohortForward(serving_model.model, reg, pad_id=tok.pad_token_id, capture_mode=MODE)
    sizes: list[int] = []
    prompts = [f"copy: {i}" for i in range(6)]  # each one bucket: 16 wide
    assert {bucket_width(len(tok(p)["input_ids"])) for p in prompts} == {16}
    plans = []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        layout = layouts.make_layout(
            f"r{i}", [len(ids)], [4], hidden_size=serving_model.hidden_size, dtype=torch.float32
        )
        plans.append((reg.register(f"r{i}", layout), ids))
    with ThreadPoolExecutor(1) as pool:
        batcher = ForwardBatcher(
            forward, pool, window_s=0.05, max_lanes=1, cohort=cohort, on_cohort=sizes.append
        )
        async with batcher:
            await asyncio.gather(*(batcher.submit(p, [ids]) for p, ids in plans))
            with pytest.raises(ValueError, match="per-request limit 1"):
                await batcher.submit(plans[0][0], [plans[0][1]] * 2)
    assert sorted(sizes) == sorted(expected)
    for p, _ in plans:  # every request got its own rows
        assert reg.consume(p.request_id, p.layout_digest).shape[0] == p.total_rows


@pytest.fixture
async def capture_service(nats_url, serving_model, tmp_path):
    nc = await nats.connect(nats_url)
    config = CaptureConfig(nats_url=nats_url, port=0, limits=Limits(prompt_len_max=64, max_lanes=4))
    signer = Signer.generate()
    async with running_capture(
        config, nc=nc, model=serving_model, signer=signer, metrics=CollectorRegistry()
    ) as running:
        yield running, nc, signer
    await nc.close()


async def test_capture_publishes_a_verifiable_block(capture_service, serving_model):
    running, nc, signer = capture_service
    sub = await nc.jetstream().pull_subscribe(streams.blocks_subject(MODEL), durable="probe")
    lanes = [
        lane(prompt="copy: abc", max_tokens=12),
        lane(messages=(("user", "copy: abc"),), max_tokens=7, temperature=0.5, seed=3),
    ]
    captured = await running.service.capture("req-1", MODEL, lanes)
    (msg,) = await sub.fetch(1, timeout=5)
    assert msg.headers["Nats-Msg-Id"] == captured.block_id
    # the rows framed by hand: the bytes are protobuf's own encoding of the block
    assert msg.data == envelope.serialize_block(envelope.parse_block(msg.data))
    verified = envelope.verify(envelope.parse_block(msg.data), TrustStore([signer.public_key]))
    header = verified.header
    assert header.request_id == "req-1" and header.block_id == captured.block_id
    assert [lane.answer_depth for lane in header.layout.lanes] == [12, 7]
    assert header.sampling[1].seed == 3 and header.sampling[1].temperature == 0.5
    assert header.forward_state_algorithm == pb.DIGEST_ALGORITHM_BLAKE3  # the default
    a, b = block_lanes(verified)
    assert torch.equal(a, b)  # the chat template renders a lone user turn like the prompt
    # ... so the second lane reads the first's rows, which the block holds once
    assert header.layout.lanes[1].rows_of_lane == 0 and header.layout.lanes[1].row_count == 0
    assert header.layout.total_rows == a.shape[0]
    assert (
        captured.prompt_tokens
        == (len(tok_ids := serving_model.tokenizer("copy: abc")["input_ids"]),) * 2
    )
    assert a.shape == (len(tok_ids), serving_model.hidden_size)
    assert running.plans.active() == 0


@pytest.mark.parametrize(
    ("model", "lanes", "param"),
    [
        ("other", [lane(prompt="hi", max_tokens=4)], "model"),
        (MODEL, [lane(prompt="", max_tokens=4)], "prompt"),
        (MODEL, [lane(prompt="x" * 100, max_tokens=4)], "prompt"),
        (MODEL, [lane(prompt="hi", max_tokens=0)], "max_tokens"),
        (MODEL, [lane(prompt="hi", max_tokens=9000)], "max_tokens"),
        (MODEL, [lane(prompt="hi", max_tokens=4)] * 5, "n"),
        (MODEL, [lane(messages=(), max_tokens=4)], "messages"),
    ],
)
async def test_capture_rejects_bad_requests_before_planning(capture_service, model, lanes, param):
    running, nc, _ = capture_service
    with pytest.raises(InvalidCapture) as info:
        await running.service.capture(None, model, lanes)
    assert info.value.param == param
    assert running.plans.active() == 0
    assert (await nc.jetstream().stream_info(streams.BLOCKS_STREAM)).state.last_seq == 0


async def test_a_long_input_is_tokenized_off_the_event_loop(capture_service, monkeypatch):
    """Over the bound, every lane is tokenized on a thread (the loop serves others meanwhile),
    to the same block and the same errors as on the loop."""
    running, nc, _ = capture_service
    threads: list[int] = []
    tokenize = running.service.tokenize

    def recording(lane, index):
        threads.append(threading.get_ident())
        return tokenize(lane, index)

    monkeypatch.setattr(running.service, "tokenize", recording)
    lanes = [lane(prompt="copy: abc", max_tokens=4), lane(prompt="copy: xy", max_tokens=4)]
    on_loop = await running.service.capture("on-loop", MODEL, lanes)
    assert set(threads) == {threading.get_ident()}
    monkeypatch.setattr(capture_service_module, "OFF_LOOP_INPUT", 16)  # both lanes: 17 chars
    threads.clear()
    off_loop = await running.service.capture("off-loop", MODEL, lanes)
    assert len(threads) == 2 and threading.get_ident() not in threads
    assert off_loop.prompt_tokens == on_loop.prompt_tokens
    with pytest.raises(InvalidCapture) as info:  # raised on the thread, the same as on the loop
        await running.service.capture(None, MODEL, [*lanes, lane(prompt="", max_tokens=4)])
    assert info.value.param == "prompt" and running.plans.active() == 0


async def test_lanes_of_one_input_are_tokenized_once(capture_service, monkeypatch):
    """`n` > 1 of one prompt (or chat, or ids): one tokenization a distinct input, every lane
    its ids; the block is the one a tokenization a lane gives."""
    running, nc, _ = capture_service
    seen: list[int] = []
    tokenize = running.service.tokenize

    def recording(lane, index):
        seen.append(index)
        return tokenize(lane, index)

    lanes = [lane(prompt="copy: abc", max_tokens=4), lane(prompt="copy: xy", max_tokens=4)]
    lanes += [lane(prompt="copy: abc", max_tokens=6), lane(prompt="copy: xy", max_tokens=4)]
    each = [tokenize(x, i) for i, x in enumerate(lanes)]
    monkeypatch.setattr(running.service, "tokenize", recording)
    got = await running.service.capture("n-lanes", MODEL, lanes)
    assert seen == [0, 1]
    assert got.prompt_tokens == tuple(len(ids) for ids in each)


async def test_a_broken_capture_publishes_nothing(capture_service, monkeypatch):
    running, nc, _ = capture_service

    def stale_record(stamp, rows, lengths):  # a hook that lies about the lane lengths
        PlanTable.record(running.plans, stamp, rows, [n - 1 for n in lengths])

    monkeypatch.setattr(running.plans, "record", stale_record)
    with pytest.raises(CaptureFailed, match="lane_length_mismatch"):
        await running.service.capture(None, MODEL, [lane(prompt="copy: a", max_tokens=4)])
    assert (await nc.jetstream().stream_info(streams.BLOCKS_STREAM)).state.last_seq == 0


async def test_compiled_capture_publishes_the_rows_of_the_eager_forward(
    nats_url, decoder_dir, serving_model, tmp_path, monkeypatch
):
    """STATEBLOCK_CAPTURE_COMPILE: the service compiles the base forward (its own model
    copy here; compiling is in place) and the published rows equal the eager capture.
    STATEBLOCK_CAPTURE_COMPILE_CACHE is where inductor's caches go, and the warm-up's cache
    lookups are in the metrics."""
    from stateblock.model.loading import load_serving_model
    from tests.helpers import REFERENCE_BASE

    config = CaptureConfig.from_env(
        {
            "STATEBLOCK_CAPTURE_COMPILE": "aot_eager",
            "STATEBLOCK_CAPTURE_PORT": "0",
            "STATEBLOCK_MAX_LANES": "1",
            "STATEBLOCK_CAPTURE_COHORT_LANES": "1",  # one shape to warm up: 1 lane x width 16
            "STATEBLOCK_PROMPT_LEN_MAX": "16",
            "STATEBLOCK_CAPTURE_COMPILE_CACHE": str(tmp_path / "compile-cache"),
        }
    )
    assert config.compile == "aot_eager"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "restored-at-teardown"))
    metrics = CollectorRegistry()
    model = load_serving_model(MODEL, REFERENCE_BASE, decoder_dir)
    nc = await nats.connect(nats_url)
    try:
        async with running_capture(
            config, nc=nc, model=model, signer=(signer := Signer.generate()),
            metrics=metrics,
        ) as running:  # fmt: skip
            sub = await nc.jetstream().pull_subscribe(streams.blocks_subject(MODEL), "probe")
            await running.service.capture("r", MODEL, [lane(prompt="copy: abc", max_tokens=4)])
            (msg,) = await sub.fetch(1, timeout=5)
    finally:
        await nc.close()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "compile-cache").resolve())
    assert (tmp_path / "compile-cache").is_dir()
    for outcome in ("hit", "miss"):  # aot_eager generates no code: lookups, if any, are kept
        labels = {"cache": "fxgraph", "outcome": outcome}
        assert metrics.get_sample_value("stateblock_capture_warmup_cache_lookups", labels) >= 0
    assert getattr(model.model.base_model, "_stateblock_compiled", None) == "aot_eager"
    # traced without the (B, 1, P, P) causal mask the eager forward leaves out too
    assert model.model.config._attn_implementation == UNMASKED_SDPA
    # kernels chosen without timing them: every replica compiles the same ones
    assert getattr(torch._inductor.config, "deterministic", True) is True
    (rows,) = block_lanes(
        envelope.verify(envelope.parse_block(msg.data), TrustStore([signer.public_key]))
    )
    eager = serving_model.prompt_rows("copy: abc", pad_to=bucket_width)
    assert torch.equal(rows, eager.to(rows.dtype))


async def test_blocks_stream_on_memory_storage(nats_url):
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js, blocks_storage="memory")
        await streams.ensure_streams(js, blocks_storage="memory")  # idempotent
        info = await js.stream_info(streams.BLOCKS_STREAM)
        assert info.config.storage == StorageType.MEMORY
        rejected = await js.stream_info(streams.REJECTED_STREAM)
        assert rejected.config.storage == StorageType.FILE  # only the work queue moves
    finally:
        await nc.close()


async def test_blocks_stream_with_the_other_storage_refuses_to_start(nats_url):
    """JetStream cannot change a stream's storage: say so instead of serving from the other."""
    nc = await nats.connect(nats_url)
    try:
        await streams.ensure_streams(nc.jetstream())  # file, the default
        with pytest.raises(streams.StreamConflict, match="exists with storage 'file'.*'memory'"):
            await streams.ensure_streams(nc.jetstream(), blocks_storage="memory")
        config = CaptureConfig(nats_url=nats_url, port=0, blocks_storage="memory")
        with pytest.raises(streams.StreamConflict):
            async with running_capture(
                config, nc=nc, model=None, signer=Signer.generate(), metrics=CollectorRegistry()
            ):
                pass
    finally:
        await nc.close()


def test_blocks_storage_from_env():
    assert CaptureConfig.from_env({}).blocks_storage == "file"
    env = {"STATEBLOCK_BLOCKS_STORAGE": "memory"}
    assert CaptureConfig.from_env(env).blocks_storage == "memory"
    with pytest.raises(ConfigError, match="STATEBLOCK_BLOCKS_STORAGE='disk' must be 'file' or"):
        CaptureConfig.from_env({"STATEBLOCK_BLOCKS_STORAGE": "disk"})


def test_forward_state_digest_from_env():
    assert CaptureConfig.from_env({}).forward_state_digest == "blake3"
    env = {"STATEBLOCK_FORWARD_STATE_DIGEST": "sha256"}
    assert CaptureConfig.from_env(env).forward_state_digest == "sha256"
    with pytest.raises(ConfigError, match="FORWARD_STATE_DIGEST: .*'md5' is not one of"):
        CaptureConfig.from_env({"STATEBLOCK_FORWARD_STATE_DIGEST": "md5"})


async def test_capture_serves_the_standard_grpc_health_service(capture_service):
    """What Kubernetes' native gRPC probes (the chart's capture probes) ask."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running, _nc, _signer = capture_service
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "stateblock.v1.Capture"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
