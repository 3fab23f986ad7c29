"""The capture's buckets and start-up warm-up: lanes padded to lane buckets with dummy lanes
that change no real lane's rows, every compiled shape run before health says SERVING, and
no compile on the request path after it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from torch._dynamo.utils import counters

import capture_svc.forward
from capture_svc.batcher import Pending, bucket_width, lane_bucket, warm_shapes, width_buckets
from capture_svc.config import CaptureConfig, CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import PlanTable, PlanTableMetrics
from capture_svc.server import CAPTURE_SERVICE, _forward, _warm_up, running_capture
from capture_svc.service import CaptureMetrics
from gateway.capture_client import never_reached_capture
from readout_svc.config import ReadoutServiceConfig
from stateblock.app.nats_server import free_port
from stateblock.model.capture import WARM_RUNS
from stateblock.model.rows import block_lanes
from stateblock.protocol import envelope, layouts, streams
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE, ConfigError
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import capture_pb2, capture_pb2_grpc
from tests.integration.test_capture_service import lane
from tests.integration.test_gateway_errors import gateway_config, gateway_for, readout_for

MODE = pb.CAPTURE_MODE_FINAL_HIDDEN
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_lane_buckets_from_env():
    assert CaptureConfig.from_env({}).lane_buckets == (1, 2, 4, 8, 16, 32)
    assert CaptureConfig.from_env({}).cohort_lane_buckets is None  # eager: no lane padding
    env = {"STATEBLOCK_CAPTURE_COMPILE": "reduce-overhead"}
    # a compiled forward never runs one lane (MIN_COMPILED_LANES)
    assert CaptureConfig.from_env(env).cohort_lane_buckets == (2, 4, 8, 16, 32)
    env |= {"STATEBLOCK_CAPTURE_LANE_BUCKETS": "4,1,16", "STATEBLOCK_CAPTURE_COHORT_LANES": "12"}
    assert CaptureConfig.from_env(env).cohort_lane_buckets == (2, 4, 12)  # the cohort closes it
    assert not CaptureConfig.from_env(env).size_oblivious
    lone = CaptureConfig.from_env(env | {"STATEBLOCK_CAPTURE_MIN_LANES": "1"})
    assert lone.cohort_lane_buckets == (1, 4, 12) and lone.size_oblivious  # a lone lane alone
    eager = CaptureConfig.from_env({"STATEBLOCK_CAPTURE_MIN_LANES": "1"})
    assert eager.cohort_lane_buckets is None and not eager.size_oblivious
    assert eager.warm_lane_buckets is None and eager.cohort_min_lanes == 1
    symbolic = CaptureConfig.from_env({"STATEBLOCK_CAPTURE_COMPILE": "default"})
    assert symbolic.cohort_lane_buckets is None and symbolic.cohort_min_lanes == 2
    assert symbolic.warm_lane_buckets == (2, 4, 8, 16, 32)
    env = {"STATEBLOCK_CAPTURE_COMPILE": "default", "STATEBLOCK_CAPTURE_LANE_BUCKETS": "2,8,32"}
    lone = CaptureConfig.from_env(env | {"STATEBLOCK_CAPTURE_MIN_LANES": "1"})
    assert lone.warm_lane_buckets == (1, 2, 8, 32)  # the fewest lanes a forward runs, warmed
    for bad in ("1,two", "0,4", "-1"):
        with pytest.raises(ConfigError, match="STATEBLOCK_CAPTURE_LANE_BUCKETS"):
            CaptureConfig.from_env({"STATEBLOCK_CAPTURE_LANE_BUCKETS": bad})


def test_the_capture_compiles_by_default_on_a_gpu_and_not_on_the_cpu():
    """Unset, STATEBLOCK_CAPTURE_COMPILE is `default` on a CUDA device (the fastest under load,
    its warm-up inside the start-up bound) and `off` on the CPU; set, it is what it says."""
    assert CaptureConfig.from_env({}).compile == "off"
    gpu = CaptureConfig.from_env({"STATEBLOCK_DEVICE": "cuda"})
    assert gpu.compile == "default" and gpu.warm_lane_buckets == (2, 4, 8, 16, 32)
    assert gpu.forwards_in_flight == 2 and not gpu.replays_graphs
    eager = CaptureConfig.from_env(
        {"STATEBLOCK_DEVICE": "cuda:1", "STATEBLOCK_CAPTURE_COMPILE": "off"}
    )
    assert eager.compile == "off" and eager.warm_lane_buckets is None


@pytest.mark.parametrize("rope", [None, "fused", "table"])
def test_the_rope_setting_reaches_the_compiled_forward(decoder_dir, rope):
    """STATEBLOCK_CAPTURE_ROPE=table gives the compiled forward the rotary table
    (`use_rope_table`); unset or `fused`, the model's own rotary stays; any other value is a
    start-up error naming the variable."""
    from stateblock.model.capture import backbone, uncompile_backbone
    from stateblock.model.loading import load_serving_model

    env = {"STATEBLOCK_CAPTURE_COMPILE": "aot_eager"}
    config = CaptureConfig.from_env(env | ({"STATEBLOCK_CAPTURE_ROPE": rope} if rope else {}))
    assert config.rope == (rope or "fused")
    model = load_serving_model(MODEL, REFERENCE_BASE, decoder_dir)  # its own: patched here
    reg = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    _forward(model, reg, config, CaptureMetrics(CollectorRegistry()))
    try:
        rotary = backbone(model.model).rotary_emb
        assert getattr(rotary, "_stateblock_table", False) == (rope == "table")
    finally:
        uncompile_backbone(model.model)
    with pytest.raises(ConfigError, match="STATEBLOCK_CAPTURE_ROPE='cached' must be one of"):
        CaptureConfig.from_env(env | {"STATEBLOCK_CAPTURE_ROPE": "cached"})


@pytest.mark.parametrize("prompt_len_max", [1, 16, 17, 24, 100, 512, 4096])
def test_width_buckets_are_every_width_a_prompt_can_get(prompt_len_max):
    reached = {bucket_width(n) for n in range(1, prompt_len_max + 1)}
    assert width_buckets(prompt_len_max) == sorted(reached)


def test_warm_shapes_cover_every_cohort_shape():
    assert len(width_buckets(4096)) == 17
    shapes = warm_shapes((1, 2, 4, 8), 4096)
    assert len(shapes) == 68 and len(set(shapes)) == 68
    for lanes in range(1, 9):
        for length in (1, 16, 17, 500, 4095, 4096):
            assert (lane_bucket(lanes, (1, 2, 4, 8)), bucket_width(length)) in shapes
    assert [lane_bucket(n, (1, 2, 4, 8)) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="exceed the largest lane bucket 8"):
        lane_bucket(9, (1, 2, 4, 8))


def test_warm_shapes_stop_at_what_a_cohort_can_carry():
    """With cohort limits, a width's lane buckets end at the bucket holding the most lanes a
    forward that wide can carry (tokens // width, one at least: a request over it goes in
    parts)."""
    buckets, cohort = (1, 2, 4, 8, 16, 32), CohortLimits(lanes=32, tokens=4096)
    shapes = warm_shapes(buckets, 4096, cohort)
    tops = {w: max(n for n, v in shapes if v == w) for w in width_buckets(4096)}
    assert tops[16] == tops[128] == 32 and tops[192] == 32  # 4096 // 192 = 21 -> bucket 32
    assert tops[256] == 16 and tops[512] == 8 and tops[1024] == 4 and tops[4096] == 1
    assert len(shapes) < len(warm_shapes(buckets, 4096))
    for width in width_buckets(4096):  # every cohort the batcher can form is covered
        for lanes in range(1, cohort.lanes_at(width) + 1):
            assert (lane_bucket(lanes, buckets), width) in shapes
    config = CaptureConfig.from_env(
        {"STATEBLOCK_CAPTURE_COMPILE": "inductor", "STATEBLOCK_CAPTURE_COHORT_LANES": "12"}
    )
    assert config.cohort == CohortLimits(12, 16384) and config.warm_lane_buckets == (2, 4, 8, 12)
    parts = CaptureConfig.from_env(
        {"STATEBLOCK_CAPTURE_PART_TOKENS": "8192", "STATEBLOCK_CAPTURE_PART_SMS": "66"}
    )
    assert parts.cohort == CohortLimits(32, 16384, 8192)  # parts smaller, cohorts as before
    assert parts.part_sms == 66 and config.part_sms is None
    assert config.cohort_lane_buckets is None  # no CUDA graphs: cohorts are not padded
    env = {"STATEBLOCK_CAPTURE_COHORT_LANES": "2", "STATEBLOCK_MAX_LANES": "6"}
    assert CaptureConfig.from_env(env).cohort.lanes == 6  # a request's lanes share a forward


def batch_shapes(model) -> tuple[list[tuple[int, ...]], Callable[[], None]]:
    """The input_ids shape of every forward of `model`, and the hook's remover."""
    seen: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return seen, handle.remove


def run_cohort(forward: CohortForward, reg: PlanTable, serving, prompts: list[str], tag: str):
    """One cohort forward of one-lane requests; each request's rows."""
    pending = []
    for i, prompt in enumerate(prompts):
        ids = serving.tokenizer(prompt)["input_ids"]
        layout = layouts.make_layout(
            f"{tag}{i}", [len(ids)], [4], hidden_size=serving.hidden_size, dtype=torch.float32
        )
        pending.append(Pending(reg.register(f"{tag}{i}", layout), [ids], None))
    forward(pending)
    return [reg.consume(p.plan.request_id, p.plan.layout_digest) for p in pending]


def test_dummy_lanes_leave_each_lanes_rows_bit_identical(serving_model):
    """Three prompts padded to the 4-lane bucket (one dummy lane) on the CPU path: each lane's
    rows equal the same prompt alone, bit for bit, and the dummy row reaches no plan."""
    model = serving_model.model
    reg = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    recorded: list[int] = []

    def record(stamp, rows, lengths):
        recorded.append(rows.shape[0])
        PlanTable.record(reg, stamp, rows, lengths)

    reg.record = record
    kwargs = dict(pad_id=serving_model.tokenizer.pad_token_id, capture_mode=MODE)
    bucketed = CohortForward(model, reg, lane_buckets=(1, 2, 4, 8), **kwargs)
    plain = CohortForward(model, reg, **kwargs)
    prompts = ["copy: a", "sort: zyxwvu", "reverse: hello"]  # one width bucket, three lengths
    seen, remove = batch_shapes(model)
    try:
        together = run_cohort(bucketed, reg, serving_model, prompts, "together")
        alone = [
            run_cohort(plain, reg, serving_model, [p], f"alone{i}")[0]
            for i, p in enumerate(prompts)
        ]
    finally:
        remove()
    assert seen[0] == (4, 16) and seen[1:] == [(1, 16)] * 3  # the dummy lane ran
    assert recorded == [3, 1, 1, 1]  # ... and its rows were cut off before the plan table
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()


def test_a_compiled_forward_gives_a_lane_the_rows_of_its_company_alone(tmp_path, monkeypatch):
    """Compiled (inductor, no CUDA graphs), a cohort runs at its own lane count, warmed or
    not, through one symbolic graph, and a prompt alone runs beside a dummy lane through
    that graph (never the one-lane graph dynamo specializes): its rows alone and in cohorts
    of three and five, padded to nothing, are equal bit for bit."""
    from torch._dynamo.utils import counters

    from stateblock.model.capture import compile_backbone, uncompile_backbone
    from stateblock.model.loading import load_base

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = CaptureConfig.from_env({"STATEBLOCK_CAPTURE_COMPILE": "inductor"})
    assert config.cohort_lane_buckets is None and config.cohort_min_lanes == 2
    model, tok = load_base(REFERENCE_BASE)
    serving = type("Serving", (), {"tokenizer": tok, "hidden_size": model.config.hidden_size})
    reg = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(
        model, reg, pad_id=tok.pad_token_id, capture_mode=MODE,
        lane_buckets=config.cohort_lane_buckets, min_lanes=config.cohort_min_lanes,
    )  # fmt: skip
    prompts = ["copy: a", "sort: zyxwvu", "reverse: hello", "copy: bb", "sort: ba"]
    seen, remove = batch_shapes(model)
    compile_backbone(model, "inductor")
    try:
        three = run_cohort(forward, reg, serving, prompts[:3], "three")
        graphs = counters["stats"]["unique_graphs"]
        five = run_cohort(forward, reg, serving, prompts, "five")
        alone = [
            run_cohort(forward, reg, serving, [p], f"alone{i}")[0] for i, p in enumerate(prompts)
        ]
        assert counters["stats"]["unique_graphs"] == graphs  # 5 and 2 lanes: no new graph
    finally:
        remove()
        uncompile_backbone(model)
    assert seen == [(3, 16), (5, 16)] + [(2, 16)] * 5  # no dummy lanes, no forward of one
    for a, b in zip(alone, three + five[3:], strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()
    for a, b in zip(three, five[:3], strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()


def lone_lane_forward():
    """The shipped base behind a CohortForward that runs a lone request as one lane, and the
    list its compiles after the warm-up land in."""
    from stateblock.model.loading import load_base

    model, tok = load_base(REFERENCE_BASE)
    serving = type("Serving", (), {"tokenizer": tok, "hidden_size": model.config.hidden_size})
    reg = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    compiles: list[int] = []
    forward = CohortForward(
        model, reg, pad_id=tok.pad_token_id, capture_mode=MODE, min_lanes=1,
        on_compile=lambda: compiles.append(1),
    )  # fmt: skip
    return model, serving, reg, forward, compiles


def test_a_forward_that_compiles_after_the_warm_up_is_reported():
    """A forward whose shape the warm-up did not reach compiles on the request's path: the
    forward says so (`on_compile`, the capture's counter). Here one lane alone without
    min_lanes, which dynamo compiles as a graph of its own."""
    from stateblock.model.capture import compile_backbone, uncompile_backbone

    model, serving, reg, forward, compiles = lone_lane_forward()
    compile_backbone(model, "aot_eager")
    try:
        forward.warm_up([(2, 16), (3, 16)])
        run_cohort(forward, reg, serving, ["copy: a", "sort: ba"], "two")
        run_cohort(forward, reg, serving, ["copy: a", "sort: ba", "copy: b", "a"], "four")
        assert compiles == []  # symbolic lanes: 2 and 4 run the warmed graph
        run_cohort(forward, reg, serving, ["copy: a"], "one")
        assert compiles == [1]  # a lone lane: a graph of its own
        run_cohort(forward, reg, serving, ["sort: ab"], "one again")
        assert compiles == [1]  # compiled once
    finally:
        uncompile_backbone(model)


def test_the_compile_settings_reach_the_threads_that_run_the_forward():
    """torch keeps a setting made in code per thread: a compile's settings (lanes without a
    case for 1, deterministic kernels) made where the backbone was compiled must also hold
    on the threads that warm it up and run its cohorts, as the capture service's executor
    does. Warmed on one thread, served on another: a lone lane runs the warmed graph."""
    from stateblock.model.capture import compile_backbone, uncompile_backbone

    model, serving, reg, forward, compiles = lone_lane_forward()
    compile_backbone(model, "aot_eager", size_oblivious=True)
    try:
        with ThreadPoolExecutor(1) as warm, ThreadPoolExecutor(1) as serve:
            warm.submit(forward.warm_up, [(2, 16), (3, 16)]).result()
            serve.submit(run_cohort, forward, reg, serving, ["copy: a"], "one").result()
            three = ["copy: a", "sort: ba", "copy: b"]
            serve.submit(run_cohort, forward, reg, serving, three, "three").result()
            seen = serve.submit(lambda: torch._inductor.config.deterministic).result()
        assert seen is True
        assert compiles == []  # one lane and three ran the graph the warm-up compiled
    finally:
        uncompile_backbone(model)


async def health(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        out = {}
        for name in ("", CAPTURE_SERVICE, "liveness"):
            request = health_pb2.HealthCheckRequest(service=name)
            out[name] = (await stub.Check(request, timeout=5)).status
        return out


async def until_listening(port: int) -> dict[str, int]:
    for _ in range(600):
        try:
            return await health(port)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


@asynccontextmanager
async def starting(capture, gate: threading.Event) -> AsyncIterator[asyncio.Task]:
    """Enters `capture` (a running_capture) in a task, so the body runs while it warms up;
    opens the gate and exits the capture at the end."""
    task = asyncio.create_task(capture.__aenter__())
    try:
        yield task
    finally:
        gate.set()
        await asyncio.wait_for(task, 300)
        await capture.__aexit__(None, None, None)


@pytest.fixture
def gated_warm_up(monkeypatch) -> threading.Event:
    """The warm-up waits for the returned event, so a test sees the service while it warms."""
    gate = threading.Event()
    real = capture_svc.forward.warm_up

    def gated(*args, **kwargs):
        assert gate.wait(60), "the test never opened the warm-up gate"
        real(*args, **kwargs)

    monkeypatch.setattr(capture_svc.forward, "warm_up", gated)
    return gate


async def test_compiled_capture_is_not_serving_until_warm_and_compiles_nothing_after(
    nc, decoder_dir, serving_model, gated_warm_up
):
    """aot_eager (the compile path without codegen) over 2 lane buckets x 2 widths: health is
    NOT_SERVING and a Capture is a retryable UNAVAILABLE while the shapes run; after, requests
    (one with a dummy lane) compile no new graph and publish the eager rows."""
    from stateblock.model.loading import load_serving_model
    from tests.helpers import REFERENCE_BASE

    port = free_port()
    env = {
        "STATEBLOCK_CAPTURE_COMPILE": "aot_eager",
        "STATEBLOCK_CAPTURE_PORT": str(port),
        "STATEBLOCK_CAPTURE_HOST": "127.0.0.1",
        "STATEBLOCK_CAPTURE_LANE_BUCKETS": "1",
        "STATEBLOCK_MAX_LANES": "3",
        "STATEBLOCK_CAPTURE_COHORT_LANES": "3",  # buckets 2 (1 runs as 2) and 3
        "STATEBLOCK_PROMPT_LEN_MAX": "24",  # widths 16 and 24
    }
    config = CaptureConfig.from_env(env)
    model = load_serving_model(MODEL, REFERENCE_BASE, decoder_dir)  # compiled in place
    seen, remove = batch_shapes(model.model)
    signer = Signer.generate()
    metrics = CollectorRegistry()
    capture = running_capture(config, nc=nc, model=model, signer=signer, metrics=metrics)
    short, long = "copy: ab", "reverse: abcdefghijklmnop"  # 6 and 20 ids: widths 16, 24
    try:
        async with starting(capture, gated_warm_up) as entered:
            assert await until_listening(port) == {
                "": NOT_SERVING, CAPTURE_SERVICE: NOT_SERVING, "liveness": SERVING
            }  # fmt: skip
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                request = capture_pb2.CaptureRequest(
                    model=MODEL, lanes=[lane(prompt="copy: a", max_tokens=4)]
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await capture_pb2_grpc.CaptureStub(channel).Capture(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert never_reached_capture(info.value)  # nothing ran: the gateway sends it again
            assert seen == []  # no forward ran, for it or the warm-up
            graphs_before_warm_up = counters["stats"]["unique_graphs"]
            gated_warm_up.set()
            running = await asyncio.wait_for(entered, 300)
            # each shape once: without CUDA graphs a shape has nothing to record or replay
            assert sorted(seen) == [(2, 16), (2, 24), (3, 16), (3, 24)]
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > graphs_before_warm_up  # the counter sees the warm-up's compiles
            assert metrics.get_sample_value("stateblock_capture_warmup_seconds") > 0
            assert await health(port) == {
                "": SERVING, CAPTURE_SERVICE: SERVING, "liveness": SERVING
            }  # fmt: skip

            sub = await nc.jetstream().pull_subscribe(streams.blocks_subject(MODEL), "probe")
            seen.clear()
            one = [lane(prompt=short, max_tokens=4)]
            await running.service.capture("one", MODEL, one)  # 1 lane + 1 dummy
            two = [lane(prompt=long, max_tokens=4), lane(prompt=short, max_tokens=4)]
            await running.service.capture("two", MODEL, two)  # 2 lanes, bucket 2
            assert seen == [(2, 16), (2, 24)]
            assert counters["stats"]["unique_graphs"] == graphs  # no compile on a request
            after = "stateblock_capture_compiled_after_warmup_total"
            assert metrics.get_sample_value(after) == 0
            msgs = await sub.fetch(2, timeout=5)
    finally:
        remove()
    trust = TrustStore([signer.public_key])
    rows = [block_lanes(envelope.verify(envelope.parse_block(m.data), trust)) for m in msgs]
    eager = {p: serving_model.prompt_rows(p, pad_to=bucket_width) for p in (short, long)}
    (one,), (two_long, two_short) = rows
    for got, prompt in ((one, short), (two_long, long), (two_short, short)):
        assert torch.equal(got, eager[prompt].to(got.dtype)), prompt


async def test_a_request_sent_during_warm_up_is_answered_after_it(
    nc, decoder_dir, serving_model, engine, gated_warm_up
):
    """Through the gateway with the official openai client: the capture refuses while it
    warms up (UNAVAILABLE, nothing ran), the gateway sends the request again, and it is
    answered once the warm-up is done."""
    port = free_port()
    signer = Signer.generate()
    readout_config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
    capture = running_capture(
        CaptureConfig(port=port, host="127.0.0.1"),
        nc=nc,
        model=serving_model,
        signer=signer,
        metrics=CollectorRegistry(),
    )
    gateway = gateway_for(
        gateway_config(decoder_dir, f"127.0.0.1:{port}", timeout_s=30.0), nc, serving_model
    )
    async with (
        starting(capture, gated_warm_up) as entered,
        readout_for(readout_config, nc, engine, TrustStore([signer.public_key])),
        gateway as gw,
    ):
        assert (await until_listening(port))[""] == NOT_SERVING
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", max_retries=0
        )
        request = asyncio.create_task(
            client.completions.create(model=MODEL, prompt="copy: ab", max_tokens=4)
        )
        await asyncio.sleep(1.0)
        assert not request.done()  # refused, and sent again while the warm-up waits
        gated_warm_up.set()
        await asyncio.wait_for(entered, 60)
        answer = await asyncio.wait_for(request, 30)
        await client.close()
    assert answer.object == "text_completion" and len(answer.choices) == 1
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("mode", "runs"), [("default", 1), ("reduce-overhead", WARM_RUNS)])
async def test_a_shape_warms_up_once_unless_its_cuda_graph_is_recorded_and_replayed(mode, runs):
    class Forward:
        def warm_up(self, shapes, runs):
            self.called = (list(shapes), runs)
            return 0.5

    forward = Forward()
    config = CaptureConfig.from_env({"STATEBLOCK_CAPTURE_COMPILE": mode, "STATEBLOCK_NATS_URL": "x",
                                     "STATEBLOCK_PROMPT_LEN_MAX": "16"})  # fmt: skip
    metrics = CollectorRegistry()
    with ThreadPoolExecutor(1) as executor:
        await _warm_up(forward, executor, config, CaptureMetrics(metrics))
    shapes = warm_shapes(config.warm_lane_buckets, 16, config.cohort)
    assert forward.called == (list(shapes), runs) and len(shapes) == 5  # lanes 2 to 32
    assert metrics.get_sample_value("stateblock_capture_warmup_seconds") == 0.5
