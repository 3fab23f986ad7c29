"""A caller that goes away cancels the capture it queued: its base forward never runs, its
plan is dropped, and no block is published for it. The only way to cancel is the caller's
own Capture call (the gateway's), before the block is published: nothing else can end a
block early."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import httpx
import nats
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from capture_svc.batcher import Dropped, ForwardBatcher
from capture_svc.forward import CohortForward
from capture_svc.plans import PlanTable, PlanTableMetrics
from readout_svc import cohorts, worker
from stateblock import settings
from stateblock.app.stack import StackThread, UpConfig
from stateblock.protocol import layouts, streams
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
    layout = layouts.make_layout(request_id, [length], [4], hidden_size=8, dtype=torch.float32)
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


async def test_drop_takes_back_a_queued_capture_and_never_a_running_one():
    """The capture's Cancel: a request still queued is dropped (its submit raises Dropped,
    nothing of it is forwarded); one whose forward started is not (it runs to its end)."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = HeldForward()
    with ThreadPoolExecutor(1) as pool:
        async with ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8) as batcher:
            first = asyncio.create_task(batcher.submit(register(plans, "first", 3), [[1] * 3]))
            queued = asyncio.create_task(batcher.submit(register(plans, "queued", 40), [[1] * 40]))
            await asyncio.to_thread(forward.started.wait, 10)
            assert batcher.drop("first") is False  # its forward is running
            assert batcher.drop("queued") is True
            assert batcher.drop("queued") is False and batcher.drop("unknown") is False
            forward.release.set()
            await first
    with pytest.raises(Dropped):
        await queued
    assert forward.cohorts == [["first"]]


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
    for `release`; one cohort forward at a time, so a request sent meanwhile queues."""
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
    one_forward = {settings.CAPTURE_FORWARDS: "1"}
    with embedded_stack(decoder_dir, tmp_path, release, one_forward) as stack:
        yield stack, forwards, running, release


@pytest.fixture
def held_readout(decoder_dir, tmp_path, monkeypatch):
    """The embedded stack, each readout recording its block's request id and then waiting
    for `release` (its block published and claimed)."""
    readouts: list[str] = []
    running, release = threading.Event(), threading.Event()
    owner: dict[int, str] = {}  # id(lane) -> its block's request id
    real_lanes, real_timed = worker.lane_requests, cohorts._timed

    def lanes_of(checked):
        lanes = real_lanes(checked)
        owner.update((id(lane), checked.header.request_id) for lane in lanes)
        return lanes

    def held(engine, lanes):
        readouts.extend(dict.fromkeys(owner[id(lane)] for lane in lanes))
        running.set()
        if not release.wait(30):
            raise TimeoutError("the test never released the readout")
        return real_timed(engine, lanes)

    monkeypatch.setattr(worker, "lane_requests", lanes_of)
    monkeypatch.setattr(cohorts, "_timed", held)
    with embedded_stack(decoder_dir, tmp_path, release) as stack:
        yield stack, readouts, running, release


@contextmanager
def embedded_stack(
    decoder_dir, tmp_path, release: threading.Event, service_settings=None
) -> Iterator[StackThread]:
    config = UpConfig(
        data_dir=tmp_path / "stack", http_port=0, grpc_port=0, workers=1,
        decoder_dir=decoder_dir, service_settings=service_settings or {},
    )  # fmt: skip
    stack = StackThread(config)
    stack.start(timeout=120)
    try:
        yield stack
    finally:
        release.set()
        stack.stop()


def test_a_grpc_call_cancelled_while_its_capture_is_queued_runs_no_forward(held_stack):
    stack, forwards, running, release = held_stack
    url = stack.urls.http
    plans = PLANS

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
    assert asyncio.run(blocks_published(stack.urls.nats_admin)) == 2  # no block: nothing to end


async def blocks_published(nats_url: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return (await nc.jetstream().stream_info(streams.BLOCKS_STREAM)).state.last_seq
    finally:
        await nc.close()


def requests_counted(http_url: str, api: str, outcome: str) -> float:
    text = httpx.get(f"{http_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "stateblock_requests_total" and s.labels == {
                "api": api,
                "outcome": outcome,
            }:
                return s.value
    return 0.0


async def gauge_is(http_url: str, value: float, what: str) -> None:
    await asyncio.to_thread(until, lambda: capture_gauge(http_url, PLANS) == value, what)


PLANS = "stateblock_capture_active_plans"
ROUTES = {
    "completions": ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 4}),
    "chat": (
        "/v1/chat/completions",
        lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 4},
    ),
}


async def post(url: str, api: str, text: str, *, stream: bool = False, key: str | None = None):
    """One request on a connection of its own: cancelling it closes that connection."""
    path, body = ROUTES[api]
    headers = {"Idempotency-Key": key} if key else {}
    async with httpx.AsyncClient(base_url=url, timeout=45) as client:
        r = await client.post(path, json={"model": MODEL, "stream": stream, **body(text)},
                              headers=headers)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.text


async def held_then_gone(stack, running, api: str, *, stream: bool, key: str | None = None):
    """A first request holds the forward; a second, queued behind it, is abandoned by its
    client (its connection closed) once its capture is planned. Returns the first's task."""
    url = stack.urls.http
    first = asyncio.create_task(post(url, "completions", "copy: a"))
    assert await asyncio.to_thread(running.wait, 20)
    gone = asyncio.create_task(post(url, api, "copy: " + "b" * 60, stream=stream, key=key))
    await gauge_is(url, 2, "the second capture was never planned")
    gone.cancel()  # the HTTP client goes away while its capture waits in the batcher
    await gauge_is(url, 1, "the abandoned capture kept its plan")
    with pytest.raises(asyncio.CancelledError):
        await gone
    return first


@pytest.mark.parametrize(("api", "stream"), [("completions", False), ("chat", True)])
def test_an_http_client_that_goes_away_while_its_capture_is_queued_runs_no_forward(
    held_stack, api, stream
):
    stack, forwards, running, release = held_stack
    url = stack.urls.http

    async def scenario() -> None:
        first = await held_then_gone(stack, running, api, stream=stream)
        release.set()
        assert await first
        assert await post(url, api, "copy: c", stream=stream)  # the forward after the first

    asyncio.run(scenario())
    assert len(forwards) == 2, forwards  # the first and the last: the abandoned one never ran
    assert capture_gauge(url, PLANS) == 0
    assert asyncio.run(blocks_published(stack.urls.nats_admin)) == 2  # no block: nothing to end
    assert requests_counted(url, api, "Cancelled") == 1


def test_a_keyed_request_abandoned_before_publish_gives_its_key_back(held_stack):
    """The retry with the key runs anew at once: it neither waits for the abandoned one's
    deadline (60 s, past the client's 45 s) nor finds a block that was never published."""
    stack, forwards, running, release = held_stack
    url = stack.urls.http

    async def scenario() -> str:
        first = await held_then_gone(stack, running, "completions", stream=False, key="gone")
        retry = asyncio.create_task(post(url, "completions", "copy: " + "b" * 60, key="gone"))
        await gauge_is(url, 2, "the retry was never captured")
        release.set()
        assert await first
        return await retry

    answer = asyncio.run(scenario())
    assert '"finish_reason"' in answer
    assert len(forwards) == 2, forwards  # the first and the retry
    assert asyncio.run(blocks_published(stack.urls.nats_admin)) == 2


def test_a_keyed_request_abandoned_while_its_forward_runs_keeps_its_block_for_the_retry(
    held_stack,
):
    """Past the point of no return (its forward running) the capture goes on to publish; the
    gateway waits for that reply and the key names the block, so a retry with the key is
    answered from it: one forward, one block."""
    stack, forwards, running, release = held_stack
    url = stack.urls.http

    async def scenario() -> str:
        gone = asyncio.create_task(post(url, "completions", "copy: a", key="running"))
        assert await asyncio.to_thread(running.wait, 20)  # its forward holds
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        retry = asyncio.create_task(post(url, "completions", "copy: a", key="running"))
        await asyncio.sleep(0.5)  # the retry finds the key held by the abandoned request
        release.set()
        return await retry

    answer = asyncio.run(scenario())
    assert '"finish_reason"' in answer
    assert len(forwards) == 1, forwards
    assert asyncio.run(blocks_published(stack.urls.nats_admin)) == 1
    until(lambda: requests_counted(url, "completions", "Cancelled") == 1, "not counted")


def test_a_keyed_request_abandoned_after_publish_is_read_and_its_retry_gets_that_answer(
    held_readout,
):
    """Its block is published: the key names it, the readout goes on, and the retry waits
    for that block's answer instead of capturing a second."""
    stack, readouts, running, release = held_readout
    url = stack.urls.http

    async def scenario() -> str:
        gone = asyncio.create_task(post(url, "completions", "copy: a", key="published"))
        assert await asyncio.to_thread(running.wait, 20)  # published, claimed, being read
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        retry = asyncio.create_task(post(url, "completions", "copy: a", key="published"))
        await asyncio.to_thread(until, lambda: requests_counted(url, "completions", "Cancelled"),
                                "the abandoned request was not cancelled")  # fmt: skip
        release.set()
        return await retry

    answer = asyncio.run(scenario())
    assert json.loads(answer)["id"] == f"cmpl-{readouts[0]}"  # the abandoned request's
    assert len(readouts) == 1, readouts  # one block, read once: the retry captured none
    assert asyncio.run(blocks_published(stack.urls.nats_admin)) == 1
