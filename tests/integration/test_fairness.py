"""One maximal request may not stall small ones (issue 38 item 3): a request over the
capture's token bound is captured in parts, a request that fits goes in the next forward
(beside a part with two forward threads, between parts with one), the parts' rows are
those of each lane alone, and through the real services a big request and small ones all
get the answers they get alone."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.batcher import ForwardBatcher, Pending
from capture_svc.config import CaptureConfig, CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import (
    CaptureIntegrityError,
    CohortStamp,
    NotRecorded,
    PlanTable,
    PlanTableMetrics,
    Slot,
)
from capture_svc.server import running_capture
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.app.nats_server import free_port
from stateblock.protocol import layouts
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.sampling import Limits
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import block_pb2 as pb
from tests.helpers import until
from tests.integration.conftest import READOUT_SIGNER
from tests.integration.test_gateway_errors import gateway_config, gateway_for

D = 8
MODE = pb.CAPTURE_MODE_FINAL_HIDDEN


def distinct_lanes(lengths) -> list[list[int]]:
    """Lanes of these lengths, each a prompt of its own (identical lanes share one forward
    lane, test_shared_lanes.py)."""
    return [[k + 1] * n for k, n in enumerate(lengths)]


def register(plans: PlanTable, rid: str, lengths, hidden: int = D):
    layout = layouts.make_layout(
        rid, list(lengths), [4] * len(lengths), hidden_size=hidden, dtype=torch.float32
    )
    return plans.register(rid, layout)


def test_a_request_recorded_in_parts_is_assembled_in_lane_order():
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    p = register(plans, "r", (3, 5, 2))
    last = torch.randn(1, 4, D)
    plans.record(CohortStamp((Slot("r", p.token, 2, 0),), MODE), last, [2])
    with pytest.raises(NotRecorded, match="1 of 3 lanes"):
        plans.consume("r", p.layout_digest)
    first = torch.randn(2, 6, D)
    slots = (Slot("r", p.token, 0, 0), Slot("r", p.token, 1, 1))
    plans.record(CohortStamp(slots, MODE), first, [3, 5])
    rows = plans.consume("r", p.layout_digest)
    assert torch.equal(rows, torch.cat([first[0, :3], first[1, :5], last[0, :2]]))


def test_a_lane_recorded_by_two_forwards_poisons_its_request():
    metrics = CollectorRegistry()
    plans = PlanTable(PlanTableMetrics(metrics), plan_ttl_s=10)
    p = register(plans, "r", (3, 5))
    plans.record(CohortStamp((Slot("r", p.token, 0, 0),), MODE), torch.randn(1, 4, D), [3])
    slots = (Slot("r", p.token, 0, 0), Slot("r", p.token, 1, 1))
    plans.record(CohortStamp(slots, MODE), torch.randn(2, 6, D), [3, 5])
    with pytest.raises(CaptureIntegrityError) as info:
        plans.consume("r", p.layout_digest)
    assert info.value.kind == "cross_request_events"
    assert metrics.get_sample_value("stateblock_capture_cross_request_events_total") == 1


class Gated:
    """A forward that records (request, first lane, lanes) of each cohort; the first waits
    for `release`."""

    def __init__(self) -> None:
        self.forwards: list[list[tuple[str, int, int]]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, cohort) -> None:
        self.forwards.append([(p.plan.request_id, p.first_lane, len(p.lane_ids)) for p in cohort])
        if len(self.forwards) == 1:
            self.started.set()
            assert self.release.wait(30), "the test never released the first forward"


class Counted(ThreadPoolExecutor):
    """An executor that counts what was handed to it."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@contextlib.asynccontextmanager
async def big_part_held(
    pool,
) -> AsyncIterator[tuple[ForwardBatcher, PlanTable, Gated, asyncio.Future]]:
    """A batcher over `pool` whose forward holds the first part of a request over the token
    bound (3 lanes x 16 > 32: parts of 2 lanes and 1) until `forward.release` is set."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = Gated()
    batcher = ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8, cohort=CohortLimits(8, 32))
    async with batcher:
        big = asyncio.ensure_future(
            batcher.submit(register(plans, "big", (9, 9, 9)), [[1] * 9, [2] * 9, [3] * 9])
        )
        await asyncio.to_thread(forward.started.wait, 10)
        yield batcher, plans, forward, big


async def test_a_request_queued_behind_a_part_goes_in_the_next_forward():
    """One forward thread (a compiled capture): a request over the token bound (3 lanes x
    16 > 32) goes in parts of 2 lanes and 1; requests that fit, queued while its first part
    runs, alternate with its parts (each waits for one part at most, and the big one is
    not starved by them)."""
    with Counted(1) as pool:
        async with big_part_held(pool) as (batcher, plans, forward, big):
            small = [
                asyncio.ensure_future(batcher.submit(register(plans, f"s{n}", (n,)), [[1] * n]))
                for n in (10, 20, 30)  # widths 16, 24, 32: a cohort each
            ]
            await until(lambda: pool.submitted == 2, "the first small cohort handed over", 10.0)
            assert not any(s.done() for s in small)
            forward.release.set()
            await asyncio.gather(big, *small)
    assert forward.forwards == [
        [("big", 0, 2)], [("s10", 0, 1)], [("big", 2, 1)], [("s20", 0, 1)], [("s30", 0, 1)]
    ]  # fmt: skip


async def test_a_request_that_fits_runs_beside_a_part_with_two_forward_threads():
    """Two forward threads (the eager capture): while a part of the big request runs, a
    small request's forward runs and its caller is answered."""
    with ThreadPoolExecutor(2) as pool:
        async with big_part_held(pool) as (batcher, plans, forward, big):
            await asyncio.wait_for(batcher.submit(register(plans, "small", (5,)), [[1] * 5]), 10)
            assert not big.done()  # its first part is still held
            assert batcher.drop("big") is False  # its forward started: it goes on
            forward.release.set()
            await big
    assert forward.forwards == [[("big", 0, 2)], [("small", 0, 1)], [("big", 2, 1)]]


@contextlib.asynccontextmanager
async def cohort_held(pool, part_yield_s: float) -> AsyncIterator[tuple]:
    """A batcher with `part_yield_s` whose cohort forward holds the first cohort (a small
    request) until `cohorts.release`; then a request over the token bound is submitted."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    cohorts, parts = Gated(), Gated()
    parts.release.set()
    batcher = ForwardBatcher(cohorts, pool, window_s=0.0, max_lanes=8, cohort=CohortLimits(8, 32),
                             forward_part=parts, part_yield_s=part_yield_s)  # fmt: skip
    async with batcher:
        small = asyncio.ensure_future(batcher.submit(register(plans, "small", (5,)), [[1] * 5]))
        await asyncio.to_thread(cohorts.started.wait, 10)
        big = asyncio.ensure_future(
            batcher.submit(register(plans, "big", (9, 9, 9)), [[1] * 9, [2] * 9, [3] * 9])
        )
        yield cohorts, parts, small, big


async def test_a_part_waits_for_the_cohorts_forward_with_a_yield():
    """STATEBLOCK_CAPTURE_PART_YIELD_S: with two forward threads a part would run beside a
    cohort's forward; with a yield it starts only once that forward is done."""
    with ThreadPoolExecutor(2) as pool:
        async with cohort_held(pool, part_yield_s=30.0) as (cohorts, parts, small, big):
            await asyncio.sleep(0.3)
            assert parts.forwards == [] and not small.done()  # held back by the cohort
            cohorts.release.set()
            await asyncio.wait_for(asyncio.gather(small, big), 10)
    assert parts.forwards == [[("big", 0, 2)], [("big", 2, 1)]]


async def test_a_part_waits_no_longer_than_its_yield():
    """A cohort that does not finish holds a part back for part_yield_s, not for ever (a
    stream of small requests never starves the big one)."""
    with ThreadPoolExecutor(2) as pool:
        async with cohort_held(pool, part_yield_s=0.4) as (cohorts, parts, small, big):
            t0 = time.monotonic()
            await until(lambda: parts.forwards, "a part ran beside the held cohort", 10.0)
            assert time.monotonic() - t0 > 0.3  # after the yield, not at once
            await until(lambda: len(parts.forwards) == 2, "the parts ran beside the cohort", 10.0)
            assert not small.done()  # its forward is still held
            cohorts.release.set()
            await asyncio.wait_for(asyncio.gather(small, big), 10)
    with ThreadPoolExecutor(2) as pool:  # without a yield the part does not wait at all
        async with cohort_held(pool, part_yield_s=0.0) as (cohorts, parts, small, big):
            await until(lambda: len(parts.forwards) == 2, "the parts ran beside the cohort", 2.0)
            cohorts.release.set()
            await asyncio.wait_for(asyncio.gather(small, big), 10)


async def forwards_of(limits: CohortLimits, *requests: tuple[str, list[list[int]]]):
    """The parts' and the cohorts' forwards when `requests` (id, lanes' ids) are submitted
    together to a batcher of `limits` with two forward threads."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    cohorts, parts = Gated(), Gated()
    cohorts.release.set()
    parts.release.set()
    with ThreadPoolExecutor(2) as pool:
        batcher = ForwardBatcher(
            cohorts, pool, window_s=0.0, max_lanes=8, cohort=limits, forward_part=parts
        )
        async with batcher:
            await asyncio.gather(*(
                batcher.submit(register(plans, rid, [len(x) for x in lanes]), lanes)
                for rid, lanes in requests
            ))  # fmt: skip
    return parts.forwards, cohorts.forwards


async def test_parts_run_through_the_background_forward_and_cohorts_through_the_other():
    """The parts of a request over the token bound go to `forward_part` (on a GPU: a stream
    of the lowest priority, `CohortForward.part`), the cohorts of requests that fit to
    `forward`; neither sees the other's."""
    parts, cohorts = await forwards_of(
        CohortLimits(8, 32), ("big", distinct_lanes((9, 9, 9))), ("small", distinct_lanes((5,)))
    )
    assert parts == [[("big", 0, 2)], [("big", 2, 1)]]
    assert cohorts == [[("small", 0, 1)]]


async def test_parts_carry_their_own_token_bound_and_cohorts_keep_theirs():
    """`CohortLimits.part_tokens` (`STATEBLOCK_CAPTURE_PART_TOKENS`) sizes the parts of a
    request over the cohort bound: with 16 tokens a part, 3 lanes x 16 go a lane a part
    (the cohort bound, 32, would make parts of 2 and 1), and a request that fits the
    cohort bound still goes whole."""
    limits = CohortLimits(8, 32, 16)
    parts, cohorts = await forwards_of(
        limits, ("big", distinct_lanes((9, 9, 9))), ("fits", distinct_lanes((9, 9)))
    )
    assert parts == [[("big", 0, 1)], [("big", 1, 1)], [("big", 2, 1)]]
    assert cohorts == [[("fits", 0, 2)]]
    assert [limits.part_lanes_at(w) for w in (8, 16, 32)] == [2, 1, 1]
    assert CohortLimits(8, 32).part_lanes_at(16) == CohortLimits(8, 32).lanes_at(16) == 2


def test_a_part_s_green_context_is_left_out_off_a_gpu(serving_model):
    """`part_sms` asks for a green context only on a CUDA device: on the CPU a part runs
    as a cohort does, with the same rows (tests/gpu has the green context itself)."""
    tok = serving_model.tokenizer
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id,
                            capture_mode=MODE, thread_streams=True, part_sms=8)  # fmt: skip
    ids = [tok("copy: green")["input_ids"]]
    rows = []
    for rid, run in (("cohort", forward), ("part", forward.part)):
        p = register(plans, rid, [len(ids[0])], serving_model.hidden_size)
        run([Pending(p, ids, None)])
        rows.append(plans.consume(rid, p.layout_digest))
    assert forward._green is None and torch.equal(rows[0], rows[1])


async def test_a_split_request_has_the_rows_of_each_lane_alone(serving_model):
    """Lanes of several widths captured a lane a forward (each over the 16-token bound
    but the shortest), and a lone lane over the bound: each lane's rows equal the same
    prompt captured alone, bit for bit."""
    tok = serving_model.tokenizer
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id, capture_mode=MODE)
    prompts = ["copy: a", "reverse: hello there friend", "sort: zyxwvutsrqponm", "add: 1+2"]
    ids = [tok(p)["input_ids"] for p in prompts]
    hidden = serving_model.hidden_size
    alone = []
    for i, lane_ids in enumerate(ids):
        p = register(plans, f"alone{i}", [len(lane_ids)], hidden)
        forward([Pending(p, [lane_ids], None)])
        alone.append(plans.consume(p.request_id, p.layout_digest))
    sizes: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        batcher = ForwardBatcher(
            forward, pool, window_s=0.0, max_lanes=8, cohort=CohortLimits(8, 16),
            on_cohort=sizes.append,
        )  # fmt: skip
        async with batcher:
            split = register(plans, "split", [len(x) for x in ids], hidden)
            lone = register(plans, "lone", [len(ids[1])], hidden)
            assert batcher.over_bound(ids) and batcher.over_bound([ids[1]])
            await asyncio.gather(batcher.submit(split, ids), batcher.submit(lone, [ids[1]]))
    assert sizes == [1] * 5  # a lane a forward
    rows = plans.consume("split", split.layout_digest)
    assert torch.equal(rows, torch.cat(alone))
    assert torch.equal(plans.consume("lone", lone.layout_digest), alone[1])


class Recording:
    """The readout engine, recording the (lanes, depth) of each execution."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.name, self.identity = engine.name, engine.identity
        if hasattr(engine, "cohort_key"):  # only an engine with one is combined or split
            self.cohort_key = engine.cohort_key
        self.warm_up = engine.warm_up
        self.executions: list[tuple[int, int]] = []

    def readout(self, lanes):
        self.executions.append((len(lanes), max(lane.depth for lane in lanes)))
        return self._engine.readout(lanes)


async def test_a_big_request_and_small_ones_all_get_their_answers_alone(
    nc, decoder_dir, serving_model
):
    """Through the real capture, readout and gateway with the official openai client: a
    big request (4 distinct prompts, over the capture's 32-token bound and the readout's
    64-position part) sent with small ones; each answer equals its prompt's answer alone,
    the big request's lanes went a forward each and its readout in parts of 2 lanes (the
    torch engine's: its cohort key lets a block be read in parts; the reference engine reads
    a block whole)."""
    from stateblock.engines.torch_engine import TorchEngine

    engine = TorchEngine.load(serving_model)
    port = free_port()
    signer = Signer.generate()
    capture_metrics = CollectorRegistry()
    capture = running_capture(
        CaptureConfig(port=port, host="127.0.0.1", cohort_tokens=32),
        nc=nc,
        model=serving_model,
        signer=signer,
        metrics=capture_metrics,
    )
    recording = Recording(engine)
    readout = running_readout(
        ReadoutServiceConfig(
            nats_url="unused", workers=4, fetch_timeout_s=0.2, limits=Limits(answer_depth_max=64)
        ),
        nc=nc,
        engine=recording,
        trust=TrustStore([signer.public_key]),
        signer=READOUT_SIGNER,
        metrics=CollectorRegistry(),
    )
    gateway = gateway_for(
        gateway_config(decoder_dir, f"127.0.0.1:{port}", timeout_s=60.0), nc, serving_model
    )
    bigs = [f"reverse: {'abcdefghijklmnopqrstuvwxyz'[i : i + 19]}" for i in range(4)]
    smalls = ["copy: ab", "sort: cba", "add: 1+2", "copy: xyz"]
    async with capture, readout, gateway as gw:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", max_retries=0
        )

        async def ask(prompt: str | list[str], n: int = 1, max_tokens: int = 8) -> list[str]:
            answer = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n, temperature=0
            )
            return [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]

        alone = {p: (await ask(p))[0] for p in smalls}
        big_alone = [(await ask(p, max_tokens=32))[0] for p in bigs]
        recording.executions.clear()
        together = await asyncio.wait_for(
            asyncio.gather(ask(bigs, max_tokens=32), *(ask(p) for p in smalls * 2)), 120
        )
        await client.close()
    assert together[0] == big_alone
    assert together[1:] == [[alone[p]] for p in smalls * 2]
    # the big request's 4 distinct lanes x 24 wide are over the 32-token bound: a lane a
    # forward
    records = capture_metrics.get_sample_value("stateblock_capture_records_total")
    assert records == len(smalls) + len(bigs) + (4 + 2 * len(smalls))
    assert (2, 32) in recording.executions and (4, 32) not in recording.executions
