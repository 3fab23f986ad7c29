"""A caller that goes away cancels the capture it queued: its base forward never runs, its
plan is dropped, and no block is published for it. The only way to cancel is the caller's
own Capture call (the gateway's), before the block is published: nothing else can end a
block early."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import nats
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from capture_svc.batcher import CohortForward, ForwardBatcher
from capture_svc.plans import PlanTable, PlanTableMetrics
from stateblock.app.stack import StackThread, UpConfig
from stateblock.protocol import envelope, streams
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import gateway_pb2, gateway_pb2_grpc


class HeldForward:
    """Records each cohort's request ids; the first cohort waits for `release`."""

    def __init__(self) -> None:
        self.cohorts: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, cohort) -> None:
        self.cohorts.append([p.plan.request_id for p in cohort])
        self.started.set()
        if not self.release.wait(30):
            raise TimeoutError("the test never released the forward")


def register(plans: PlanTable, request_id: str, length: int):
    layout = envelope.make_layout(request_id, [length], [4], hidden_size=8, dtype=torch.float32)
    return plans.register(request_id, layout)


async def test_a_cancelled_capture_behind_a_running_cohort_is_never_forwarded():
    """Two requests taken in one batch but of different bucket widths run as two cohorts,
    one forward after the other: the second, cancelled while the first runs, is dropped."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = HeldForward()
    with ThreadPoolExecutor(1) as pool:
        async with ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8) as batcher:
            first = asyncio.create_task(batcher.submit(register(plans, "first", 3), [[1] * 3]))
            queued = asyncio.create_task(batcher.submit(register(plans, "queued", 40), [[1] * 40]))
            await asyncio.to_thread(forward.started.wait, 10)
            assert forward.cohorts == [["first"]]  # "queued" waits for its own cohort
            queued.cancel()
            await asyncio.sleep(0)
            forward.release.set()
            await first
            later = asyncio.create_task(batcher.submit(register(plans, "later", 3), [[1] * 3]))
            await later  # the batcher went on: the next request's forward ran
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert forward.cohorts == [["first"], ["later"]]


def capture_gauge(http_url: str, name: str) -> float:
    text = httpx.get(f"{http_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name}")


def until(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


@pytest.fixture
def held_stack(decoder_dir, tmp_path, monkeypatch):
    """The embedded stack, each base forward recording its lanes' lengths and then waiting
    for `release`."""
    forwards: list[list[int]] = []
    running, release = threading.Event(), threading.Event()
    real = CohortForward.__call__

    def held(self, cohort) -> None:
        forwards.append([len(ids) for p in cohort for ids in p.lane_ids])
        running.set()
        if not release.wait(30):
            raise TimeoutError("the test never released the forward")
        real(self, cohort)

    monkeypatch.setattr(CohortForward, "__call__", held)
    config = UpConfig(
        data_dir=tmp_path / "stack", http_port=0, grpc_port=0, workers=1, decoder_dir=decoder_dir
    )
    stack = StackThread(config)
    stack.start(timeout=120)
    try:
        yield stack, forwards, running, release
    finally:
        release.set()
        stack.stop()


def test_a_grpc_call_cancelled_while_its_capture_is_queued_runs_no_forward(held_stack):
    stack, forwards, running, release = held_stack
    url = stack.urls.http
    plans = "stateblock_capture_active_plans"

    def ask(prompt: str) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(model=MODEL, prompt=prompt, max_tokens=4)

    with grpc.insecure_channel(stack.urls.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = stub.Generate.future(ask("copy: a"), timeout=60)
        assert running.wait(20)  # its forward holds the forward thread
        gone = stub.Generate.future(ask("copy: " + "b" * 60), timeout=60)
        until(lambda: capture_gauge(url, plans) == 2, "the second capture was never planned")
        gone.cancel()  # the client goes away while its capture waits in the batcher
        until(lambda: capture_gauge(url, plans) == 1, "the cancelled capture kept its plan")
        release.set()
        assert first.result().request_id
        after = stub.Generate(ask("copy: c"), timeout=60)  # the forward after the first
    assert after.request_id
    with pytest.raises(grpc.FutureCancelledError):
        gone.result()
    assert len(forwards) == 2, forwards  # the first and the last: the cancelled one never ran
    assert capture_gauge(url, plans) == 0

    async def blocks_published() -> int:
        nc = await nats.connect(stack.urls.nats)
        try:
            return (await nc.jetstream().stream_info(streams.BLOCKS_STREAM)).state.last_seq
        finally:
            await nc.close()

    assert asyncio.run(blocks_published()) == 2  # no block, so nothing to read or to end
