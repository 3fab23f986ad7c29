"""A long prompt lane captured a chunk at a time (STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS): a
chunk a turn of the parts' runner, cohorts between chunks, the yield held between chunks,
rows of one forward up to rounding and the same whatever the company, and through the real
services every answer that of its prompt alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.batcher import ForwardBatcher, Pending, bucket_width, warm_shapes
from capture_svc.config import CaptureConfig, CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import PlanTable, PlanTableMetrics
from capture_svc.server import running_capture
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.app.nats_server import free_port
from stateblock.engines import ReferenceEngine
from stateblock.model.loading import load_serving_model
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.sampling import Limits
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE, REFERENCE_DECODER
from tests.integration.conftest import READOUT_SIGNER
from tests.integration.test_fairness import MODE, Gated, register
from tests.integration.test_gateway_errors import gateway_config, gateway_for

CHUNKED = CohortLimits(8, 64, None, 8)  # lanes over 8 tokens run in chunks of 8


class Chunks(Gated):
    """A part forward that takes `steps` calls a lane (False until the last), recording
    (request, lane, call) of each; the first call waits for `release`."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.steps, self.calls = steps, {}

    def __call__(self, cohort) -> bool:
        (p,) = cohort
        n = self.calls[p.plan.request_id, p.first_lane] = (
            self.calls.get((p.plan.request_id, p.first_lane), 0) + 1
        )
        super().__call__([p])
        self.forwards[-1] = [(p.plan.request_id, p.first_lane, n)]
        return n == self.steps


def test_a_long_lane_goes_in_parts_whatever_the_cohort_bound():
    """A lane over the chunk bound makes its request a parts request even when it fits the
    cohort's tokens, and its parts carry one lane."""
    batcher = ForwardBatcher(Gated(), None, window_s=0.0, max_lanes=8, cohort=CHUNKED)
    assert batcher.over_bound([[1] * 9]) and not batcher.over_bound([[1] * 8, [1] * 8])
    assert CHUNKED.part_lanes_at(16) == 1 and CHUNKED.part_lanes_at(8) == 8
    assert not CohortLimits(8, 64).chunked(10_000)


def test_the_compiled_warm_up_stops_at_the_chunk_bound():
    """A lane over the chunk bound never runs compiled: the warm-up's widths stop at the
    bucket that holds the bound, instead of the prompt limit's."""
    env = {"STATEBLOCK_CAPTURE_COMPILE": "default", "STATEBLOCK_PROMPT_LEN_MAX": "4096"}
    plain = CaptureConfig.from_env(env)
    chunked = CaptureConfig.from_env({**env, "STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS": "1000"})
    assert (plain.warm_width_max, chunked.warm_width_max) == (4096, 1000)
    assert chunked.cohort.chunked(1001) and not plain.cohort.chunked(4096)
    widths = {w for _, w in warm_shapes(chunked.warm_lane_buckets, 1000, chunked.cohort)}
    assert max(widths) == bucket_width(1000) == 1024


async def test_a_cohort_runs_between_a_long_lane_s_chunks():
    """One forward thread: a small request queued while a long lane's first chunk runs goes
    in the next forward, before the lane's second chunk; the lane's chunks all run, in
    order, and its request resolves after the last."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    cohorts, chunks = Gated(), Chunks(steps=3)
    cohorts.release.set()
    with ThreadPoolExecutor(1) as pool:
        batcher = ForwardBatcher(cohorts, pool, window_s=0.0, max_lanes=8, cohort=CHUNKED,
                                 forward_part=chunks)  # fmt: skip
        async with batcher:
            big = asyncio.ensure_future(batcher.submit(register(plans, "big", (20,)), [[1] * 20]))
            await asyncio.to_thread(chunks.started.wait, 10)
            small = asyncio.ensure_future(batcher.submit(register(plans, "small", (5,)), [[1] * 5]))
            await asyncio.sleep(0.1)
            assert not big.done() and not small.done()
            chunks.release.set()
            await asyncio.wait_for(asyncio.gather(big, small), 10)
    assert chunks.forwards == [[("big", 0, 1)], [("big", 0, 2)], [("big", 0, 3)]]
    assert cohorts.forwards == [[("small", 0, 1)]]
    assert chunks.calls == {("big", 0): 3}


async def test_the_yield_holds_the_next_chunk_back_for_a_cohort():
    """Two forward threads and STATEBLOCK_CAPTURE_PART_YIELD_S: a cohort that starts while a
    chunk runs keeps the lane's next chunk from starting until it is done, so a small forward
    shares the device with one chunk at most."""
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    cohorts, chunks = Gated(), Chunks(steps=3)
    with ThreadPoolExecutor(2) as pool:
        batcher = ForwardBatcher(cohorts, pool, window_s=0.0, max_lanes=8, cohort=CHUNKED,
                                 forward_part=chunks, part_yield_s=30.0)  # fmt: skip
        async with batcher:
            big = asyncio.ensure_future(batcher.submit(register(plans, "big", (20,)), [[1] * 20]))
            await asyncio.to_thread(chunks.started.wait, 10)
            small = asyncio.ensure_future(batcher.submit(register(plans, "small", (5,)), [[1] * 5]))
            await asyncio.to_thread(cohorts.started.wait, 10)  # the cohort runs beside chunk 1
            chunks.release.set()
            await asyncio.sleep(0.3)
            assert chunks.forwards == [[("big", 0, 1)]]  # chunk 2 waits for the cohort
            cohorts.release.set()
            await asyncio.wait_for(asyncio.gather(big, small), 10)
    assert len(chunks.forwards) == 3


async def test_a_chunked_lane_has_the_rows_of_one_forward_whatever_its_company(serving_model):
    """The real forward: a request of a long lane and a short one, captured with the long lane
    in chunks of 8: the long lane's rows equal its one forward's up to rounding, the short
    lane's bit for bit, and the long lane alone (in chunks too) gives the same rows bit for
    bit as beside the short lane."""
    tok = serving_model.tokenizer
    hidden = serving_model.hidden_size
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id,
                            capture_mode=MODE, part_chunk=8)  # fmt: skip
    long_ids = tok("reverse: abcdefghijklmnopqrs")["input_ids"]
    short_ids = tok("add: 1+2")["input_ids"]
    assert len(long_ids) > 8 >= len(short_ids)
    whole = []
    for rid, ids in (("w-long", long_ids), ("w-short", short_ids)):
        p = register(plans, rid, [len(ids)], hidden)
        forward([Pending(p, [ids], None)])
        whole.append(plans.consume(rid, p.layout_digest))
    records: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        batcher = ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8,
                                 cohort=CohortLimits(8, 64, None, 8), on_cohort=records.append,
                                 forward_part=forward.part)  # fmt: skip
        async with batcher:
            both = register(plans, "both", [len(long_ids), len(short_ids)], hidden)
            alone = register(plans, "alone", [len(long_ids)], hidden)
            await batcher.submit(both, [long_ids, short_ids])
            await batcher.submit(alone, [long_ids])
    rows = plans.consume("both", both.layout_digest)
    n = len(long_ids)
    torch.testing.assert_close(rows[:n], whole[0], atol=1e-3, rtol=1e-3)
    assert not torch.equal(rows[:n], whole[0])  # it did run in chunks
    assert torch.equal(rows[n:], whole[1])
    assert torch.equal(plans.consume("alone", alone.layout_digest), rows[:n])
    assert records == [1, 1, 1]  # a forward's lanes counted once a part is whole


@pytest.mark.parametrize("chunk, longest", [(8, 64), (64, 64), (80, 64)])
def test_the_warm_up_makes_the_chunk_runner_for_the_longest_prompt(serving_model, chunk, longest):
    """The warm-up makes the chunks' runner (each of its spans run once; on CUDA, its
    graphs recorded), whether the chunk is a small part of the longest prompt, all of it, or
    longer; a lane of the longest prompt then fits it."""
    tok = serving_model.tokenizer
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id,
                            capture_mode=MODE, part_chunk=chunk, part_chunk_len=longest)  # fmt: skip
    forward.warm_up()
    runner = forward.chunk_runner
    assert runner is not None and runner.chunk == chunk and runner.cache_len >= longest
    assert runner.cache_len % chunk == 0 and runner.spans[-1] == runner.cache_len


async def test_two_long_requests_interleaved_chunk_by_chunk_keep_their_rows(serving_model):
    """Two requests of long lanes at once: their parts go round-robin, a chunk each a turn,
    through the one chunk runner (its cache handed from lane to lane); each lane's rows are
    bit for bit those of the same lane captured alone."""
    tok = serving_model.tokenizer
    hidden = serving_model.hidden_size
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id,
                            capture_mode=MODE, part_chunk=8, part_chunk_len=64)  # fmt: skip
    prompts = ["reverse: abcdefghijklmnopqrs", "sort: zyxwvutsrqponmlkjihgf", "copy: qwertyuiopasd"]
    lanes = [tok(p)["input_ids"] for p in prompts]
    assert all(len(ids) > 16 for ids in lanes)
    steps: list[str] = []
    part = forward.part

    def recording(cohort):
        steps.append(cohort[0].plan.request_id)
        return part(cohort)

    with ThreadPoolExecutor(2) as pool:
        batcher = ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8, cohort=CHUNKED,
                                 forward_part=recording)  # fmt: skip
        async with batcher:
            alone = []
            for i, ids in enumerate(lanes):
                plan = register(plans, f"alone-{i}", [len(ids)], hidden)
                await batcher.submit(plan, [ids])
                alone.append(plans.consume(f"alone-{i}", plan.layout_digest))
            both = [register(plans, "a", [len(lanes[0]), len(lanes[1])], hidden),
                    register(plans, "b", [len(lanes[2])], hidden)]  # fmt: skip
            steps.clear()
            await asyncio.gather(batcher.submit(both[0], lanes[:2]),
                                 batcher.submit(both[1], lanes[2:]))  # fmt: skip
    assert steps[:4] == ["a", "b", "a", "b"]  # the chunks took turns
    a = plans.consume("a", both[0].layout_digest)
    b = plans.consume("b", both[1].layout_digest)
    n = len(lanes[0])
    assert torch.equal(a[:n], alone[0]) and torch.equal(a[n:], alone[1])
    assert torch.equal(b, alone[2])


@pytest.fixture(scope="module")
def shipped():
    return load_serving_model(MODEL, REFERENCE_BASE, REFERENCE_DECODER)


async def test_a_long_prompt_in_chunks_answers_as_alone_through_the_services(nc, shipped):
    """Through the real capture (chunks of 8 tokens, a yield), readout and gateway with the
    official openai client, on the shipped pair: a long prompt's answer from rows captured in
    chunks is the right one; with n=4 beside small requests every answer equals its prompt's
    answer alone, and the capture ran the long lanes a part each."""
    serving_model = shipped
    port = free_port()
    signer = Signer.generate()
    capture_metrics = CollectorRegistry()
    capture = running_capture(
        CaptureConfig(port=port, host="127.0.0.1", part_chunk_tokens=8, part_yield_s=0.5),
        nc=nc, model=serving_model, signer=signer, metrics=capture_metrics,
    )  # fmt: skip
    readout = running_readout(
        ReadoutServiceConfig(
            nats_url="unused", workers=4, fetch_timeout_s=0.2, limits=Limits(answer_depth_max=64)
        ),
        nc=nc,
        engine=ReferenceEngine.load(shipped),
        trust=TrustStore([signer.public_key]),
        signer=READOUT_SIGNER,
        metrics=CollectorRegistry(),
    )
    gateway = gateway_for(
        gateway_config(REFERENCE_DECODER, f"127.0.0.1:{port}", timeout_s=60.0), nc, serving_model
    )
    big, smalls = "reverse: abcdefgh", ["copy: ab", "sort: cba", "add: 1+2"]
    async with capture, readout, gateway as gw:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", max_retries=0
        )

        async def ask(prompt: str, n: int = 1, max_tokens: int = 8) -> list[str]:
            answer = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n, temperature=0
            )
            return [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]

        alone = {p: (await ask(p))[0] for p in smalls}
        big_alone = (await ask(big, max_tokens=32))[0]
        together = await asyncio.wait_for(
            asyncio.gather(ask(big, n=4, max_tokens=32), *(ask(p) for p in smalls * 2)), 120
        )
        await client.close()
    assert big_alone == "hgfedcba"  # the shipped pair reverses it, from rows in chunks
    assert together[0] == [big_alone] * 4
    assert together[1:] == [[alone[p]] for p in smalls * 2]
    records = capture_metrics.get_sample_value("stateblock_capture_records_total")
    assert records == len(smalls) + 1 + (1 + 2 * len(smalls))  # n=4 of one prompt: one lane
    # the capture's stages by route: a request with a lane over the chunk bound went in parts
    sent = [*smalls, big, big, *smalls, *smalls]
    in_parts = sum(len(shipped.tokenizer(p)["input_ids"]) > 8 for p in sent)
    assert 2 <= in_parts < len(sent)

    def forwards(route: str) -> float:
        labels = {"stage": "forward", "route": route}
        return capture_metrics.get_sample_value("stateblock_capture_stage_seconds_count", labels)

    assert (forwards("parts"), forwards("cohort")) == (in_parts, len(sent) - in_parts)
