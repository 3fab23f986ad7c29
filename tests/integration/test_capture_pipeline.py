"""The capture's cohorts runner keeps `in_flight` forwards going at once (the next cohort
runs on the device while the last one's rows go out), never more,
and every caller is answered; a cohort's rows going to the host never hold up the event
loop's plan table calls."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc import plans as plan_table
from capture_svc.batcher import ForwardBatcher, Pending
from capture_svc.config import CUDA_GRAPH_MODES, MIN_COMPILED_LANES, CaptureConfig, CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import CohortStamp, PlanTable, PlanTableMetrics, Slot
from stateblock.model.capture import compile_backbone
from stateblock.protocol import layouts
from stateblock.runtime import ConfigError
from stateblock.v1 import block_pb2 as pb
from tests.integration.test_fairness import until


class Held:
    """A forward that counts the cohorts running at once; each waits for `release`."""

    def __init__(self) -> None:
        self.lock, self.release = threading.Lock(), threading.Event()
        self.running = self.peak = 0
        self.lanes: list[int] = []

    def __call__(self, cohort) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.lanes.append(sum(len(p.lane_ids) for p in cohort))
        try:
            assert self.release.wait(30), "the test never released the forwards"
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.parametrize("in_flight", [1, 2, 3])
async def test_the_cohorts_runner_keeps_in_flight_forwards_going_and_no_more(in_flight):
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = Held()
    one_lane = CohortLimits(lanes=1, tokens=1 << 20)  # every request a cohort of its own
    with ThreadPoolExecutor(4) as pool:
        batcher = ForwardBatcher(
            forward, pool, window_s=0.0, max_lanes=1, cohort=one_lane, in_flight=in_flight
        )
        async with batcher:
            submitted = []
            for i in range(6):
                layout = layouts.make_layout(f"r{i}", [4], [4], hidden_size=8, dtype=torch.float32)
                plan = plans.register(f"r{i}", layout)
                submitted.append(asyncio.ensure_future(batcher.submit(plan, [[1] * 4])))
            await until(lambda: forward.running == in_flight, f"{in_flight} forwards at once")
            await asyncio.sleep(0.2)  # the others wait for one of them to end
            assert forward.running == in_flight and not any(f.done() for f in submitted)
            forward.release.set()
            await asyncio.wait_for(asyncio.gather(*submitted), 30)
    assert forward.peak == in_flight and forward.lanes == [1] * 6
    timings = [f.result() for f in submitted]  # the forwards held 0.2 s at least
    assert all(t.ran >= 0.2 for t in timings[:in_flight])
    assert all(t.waited >= 0.2 for t in timings[in_flight:])  # behind the held ones
    assert all(t.started is not None and t.waited <= 30 for t in timings)


def test_a_requests_parts_share_its_timing():
    layout = layouts.make_layout("r", [4] * 4, [4] * 4, hidden_size=8, dtype=torch.float32)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    loop = asyncio.new_event_loop()
    try:
        whole = Pending(plans.register("r", layout), [[1] * 4] * 4, loop.create_future())
    finally:
        loop.close()
    parts = whole.parts(1)
    for i, part in enumerate(parts):
        part.timing.forward(10.0 + i, 0.5)
    assert whole.timing.ran == 2.0 and whole.timing.started == 10.0
    assert whole.timing.waited == 10.0 - whole.timing.submitted


@pytest.fixture(scope="module")
def compiled_model(serving_model):
    """A copy of the served base whose backbone is compiled (`aot_eager`: dynamo's graphs
    on the CPU without code generation), beside the eager one the other tests use."""
    model = copy.deepcopy(serving_model.model)
    compile_backbone(model, "aot_eager")
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
async def test_forwards_in_flight_give_each_request_its_rows_alone(
    serving_model, compiled_model, compiled
):
    """Two cohort forwards at once, on threads (and streams) of their own, eager or compiled
    without CUDA graphs: each request's rows are those it gets alone, one forward at a time."""
    tok = serving_model.tokenizer
    prompts = [f"copy: {'ab' * i}" for i in range(1, 9)]
    model = compiled_model if compiled else serving_model.model
    least = MIN_COMPILED_LANES if compiled else 1  # a compiled lone lane has company

    async def rows(in_flight: int, lanes: int) -> list[torch.Tensor]:
        plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=30)
        forward = CohortForward(
            model, plans, pad_id=tok.pad_token_id, capture_mode=pb.CAPTURE_MODE_FINAL_HIDDEN,
            min_lanes=least, thread_streams=True,
        )  # fmt: skip
        cohort = CohortLimits(lanes=lanes, tokens=1 << 20)
        with ThreadPoolExecutor(in_flight + 1) as pool:
            batcher = ForwardBatcher(
                forward, pool, window_s=0.0, max_lanes=1, cohort=cohort, in_flight=in_flight
            )
            async with batcher:
                submitted = []
                for i, prompt in enumerate(prompts):
                    ids = tok(prompt)["input_ids"]
                    layout = layouts.make_layout(
                        f"r{i}", [len(ids)], [4], hidden_size=serving_model.hidden_size,
                        dtype=torch.float32,
                    )  # fmt: skip
                    plan = plans.register(f"r{i}", layout)
                    submitted.append((plan, batcher.submit(plan, [ids])))
                await asyncio.gather(*(s for _, s in submitted))
        return [plans.consume(p.request_id, p.layout_digest) for p, _ in submitted]

    alone = await rows(in_flight=1, lanes=1)
    for a, b in zip(alone, await rows(in_flight=2, lanes=2), strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()


def test_forwards_at_once_follow_the_device_and_cuda_graphs_run_one():
    def config(**kw) -> CaptureConfig:
        return CaptureConfig(nats_url="unused", **kw)

    assert config().forwards_in_flight == 1  # the CPU: one forward uses every core
    assert config(device="cuda").forwards_in_flight == 2
    assert config(device="cuda", compile="default").forwards_in_flight == 2
    assert config(forwards=3, compile="inductor").forwards_in_flight == 3
    for mode in CUDA_GRAPH_MODES:  # a CUDA graph replays on the thread that recorded it
        assert config(device="cuda", forwards=2, compile=mode).forwards_in_flight == 1
    with pytest.raises(ConfigError, match="STATEBLOCK_CAPTURE_FORWARDS"):
        CaptureConfig.from_env({"STATEBLOCK_CAPTURE_FORWARDS": "0", "STATEBLOCK_NATS_URL": "x"})


def test_rows_going_to_the_host_do_not_hold_the_plan_table(monkeypatch):
    """A GPU's rows reach the host only once its forward's kernels are done: `record` makes
    that copy after it lets go of the table's lock, so a request registering (or one
    consuming) on the event loop meanwhile does not wait for the forward."""
    copying, done = threading.Event(), threading.Event()

    def slow_to_host(rows):
        copying.set()
        assert done.wait(30), "the test never let the copy end"
        return rows.clone()

    monkeypatch.setattr(plan_table, "to_host", slow_to_host)
    table = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=30, host_rows=True)

    def layout(rid: str):
        return layouts.make_layout(rid, [3], [4], hidden_size=8, dtype=torch.float32)

    plan = table.register("a", layout("a"))
    rows = torch.randn(1, 4, 8)
    stamp = CohortStamp((Slot("a", plan.token, 0, 0),), pb.CAPTURE_MODE_FINAL_HIDDEN)
    forward = threading.Thread(target=table.record, args=(stamp, rows, [3]))
    forward.start()
    assert copying.wait(10)
    registered = threading.Thread(target=table.register, args=("b", layout("b")))
    registered.start()
    registered.join(5)
    alive = registered.is_alive()
    done.set()
    forward.join(10)
    registered.join(10)
    assert not alive, "register waited for the rows' copy to the host"
    assert torch.equal(table.consume("a", plan.layout_digest), rows[0, :3])


async def test_a_stop_fails_the_cohorts_still_waiting_for_a_forward():
    """One forward at a time: a batch of two cohorts (two widths) whose second waits for the
    first's forward. Stopping then lets the running forward finish and answer its caller, and
    fails the waiting cohort's caller at once instead of leaving it waiting forever."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = Held()
    with ThreadPoolExecutor(2) as pool:
        # a window: both requests go in one batch, whose cohorts the runner starts in turn
        batcher = ForwardBatcher(
            forward, pool, window_s=0.3, max_lanes=1, cohort=CohortLimits(8, 1 << 20), in_flight=1
        )
        await batcher.__aenter__()
        submitted = []
        for rid, width in (("narrow", 4), ("wide", 20)):  # buckets 16 and 24: two cohorts
            layout = layouts.make_layout(rid, [width], [4], hidden_size=8, dtype=torch.float32)
            plan = plans.register(rid, layout)
            submitted.append(asyncio.ensure_future(batcher.submit(plan, [[1] * width])))
        await until(lambda: forward.running == 1, "the first cohort's forward")
        stopping = asyncio.ensure_future(batcher.__aexit__(None, None, None))
        await asyncio.sleep(0.1)
        forward.release.set()
        await asyncio.wait_for(stopping, 30)
        narrow, wide = await asyncio.wait_for(
            asyncio.gather(*submitted, return_exceptions=True), 10
        )
    assert narrow.ran >= 0.1 and forward.lanes == [1]  # answered, its forward timed
    assert isinstance(wide, RuntimeError) and "shutting down" in str(wide)
