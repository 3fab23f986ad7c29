"""Readout cohorts: the blocks a process holds at once, read in one engine execution, each
answer the same as the block read alone (the shipped model, reference and torch engines)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from readout_svc.cohorts import ReadoutCohorts
from stateblock.engines import LaneRequest
from tests.engine_fixtures import lanes_of
from tests.helpers import until


class Counting:
    """The engine, counting executions and the lanes of each; `poison` makes a cohort that
    holds that many-lane block raise (and that block alone too)."""

    def __init__(self, engine, poison_depth: int | None = None) -> None:
        self._engine = engine
        self.name, self.identity = engine.name, engine.identity
        self.calls: list[int] = []
        self._poison = poison_depth
        if hasattr(engine, "cohort_key"):
            self.cohort_key = engine.cohort_key

    def readout(self, lanes):
        self.calls.append(len(lanes))
        if self._poison is not None and any(lane.depth == self._poison for lane in lanes):
            raise RuntimeError("poisoned lane")
        return self._engine.readout(lanes)


def blocks_of(captured) -> list[list[LaneRequest]]:
    """Six blocks of one prompt's rows: one lane each at depth 48 (one a seeded sampled
    lane), a two-lane block at 48, and one at depth 200 (another key: never combined with
    the 48s); and two of other prompts, whose lengths the reference's key tells apart."""
    return [
        lanes_of(captured[:1], [48]),
        lanes_of(captured[:1], [48], temps=[0.8], seeds=[5]),
        lanes_of(captured[:1], [48, 48], temps=[0.0, 1.2], seeds=[None, 6]),
        lanes_of(captured[:1], [48]),
        lanes_of(captured[:1], [200]),
        lanes_of(captured[1:2], [48]),
        lanes_of(captured[4:5], [48]),
    ]


async def read_all(engine, blocks, *, max_lanes: int, cancel: int | None = None):
    with ThreadPoolExecutor(1) as pool:
        async with ReadoutCohorts(engine, pool, max_lanes=max_lanes) as cohorts:
            tasks = [asyncio.ensure_future(cohorts.read(b)) for b in blocks]
            if cancel is not None:
                tasks[cancel].cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("engine_name", ["reference", "torch"])
async def test_blocks_read_together_answer_as_alone(engine_name, reference, engine, captured):
    inner = reference if engine_name == "reference" else engine
    blocks = blocks_of(captured)
    alone = [inner.readout(b) for b in blocks]
    counting = Counting(inner)
    outs = await read_all(counting, blocks, max_lanes=8)
    for (results, seconds), want in zip(outs, alone, strict=True):
        assert results == want and seconds > 0
    assert sum(counting.calls) == sum(len(b) for b in blocks)
    if engine_name == "reference":  # no key: every block alone
        assert sorted(counting.calls) == sorted(len(b) for b in blocks)
    else:  # blocks of one key go together (bit for bit the same as alone), others apart
        assert len(counting.calls) < len(blocks) and max(counting.calls) >= 4


async def test_cohorts_keep_to_max_lanes(engine, captured):
    counting = Counting(engine)
    blocks = [lanes_of(captured[:1], [16])] * 7
    outs = await read_all(counting, blocks, max_lanes=3)
    assert all(results == engine.readout(blocks[0]) for results, _ in outs)
    assert max(counting.calls) == 3 and sum(counting.calls) == 7


async def test_an_engine_without_a_key_reads_block_by_block(reference, captured):
    counting = Counting(reference)  # the reference and ONNX engines: no key
    assert not hasattr(counting, "cohort_key")
    outs = await read_all(counting, [lanes_of(captured[:1], [16])] * 4, max_lanes=8)
    assert len(outs) == 4 and counting.calls == [1, 1, 1, 1]


async def test_a_failing_block_fails_only_itself(reference, captured):
    """A cohort whose execution raises is read again block by block."""
    counting = Counting(reference, poison_depth=33)
    blocks = [lanes_of(captured[i : i + 1], [33 if i == 2 else 16]) for i in range(4)]
    counting.cohort_key = lambda lanes: "one"  # so the poisoned block shares the cohort
    outs = await read_all(counting, blocks, max_lanes=8)
    assert isinstance(outs[2], RuntimeError)
    for i in (0, 1, 3):
        assert outs[i][0] == reference.readout(blocks[i])


async def test_a_cancelled_read_is_not_executed(reference, captured):
    counting = Counting(reference)
    blocks = [lanes_of(captured[i : i + 1], [16]) for i in range(4)]
    outs = await read_all(counting, blocks, max_lanes=8, cancel=3)
    assert isinstance(outs[3], asyncio.CancelledError)
    assert sum(counting.calls) == 3  # the cancelled block's lane never reached the engine


@pytest.mark.parametrize("engine_name", ["reference", "torch"])
async def test_a_long_block_is_read_in_parts_and_answers_as_whole(
    engine_name, reference, engine, captured
):
    """A block of more answer positions than a part carries goes in parts of lanes that
    share its cohort key: the same results, bit for bit, as the block read whole (an engine
    without a key, the reference, reads it whole)."""
    inner = reference if engine_name == "reference" else engine
    block = lanes_of(
        captured[:1], [48] * 5, temps=[0.0, 0.9, 0.0, 1.1, 0.0], seeds=[None, 3, None, 4, None]
    )
    counting = Counting(inner)
    with ThreadPoolExecutor(2) as pool:
        async with ReadoutCohorts(
            counting, pool, max_lanes=8, concurrency=2, part_positions=96
        ) as cohorts:
            results, seconds = await cohorts.read(block)
    assert results == inner.readout(block) and seconds > 0
    assert counting.calls == ([5] if engine_name == "reference" else [2, 2, 1])


async def test_a_long_block_whose_parts_would_read_otherwise_is_read_whole(reference, captured):
    """A part of other lanes would read otherwise (here the reference engine's: its
    products sum by the lanes' count and it pads to the longest prompt), so the block is
    read whole (still apart from the cohorts)."""
    counting = Counting(reference)
    block = lanes_of([captured[1], captured[4]], [48, 48, 48])  # two prompt lengths
    with ThreadPoolExecutor(2) as pool:
        async with ReadoutCohorts(
            counting, pool, max_lanes=8, concurrency=2, part_positions=48
        ) as cohorts:
            results, _ = await cohorts.read(block)
    assert results == reference.readout(block) and counting.calls == [3]


class Held(Counting):
    """Executions of lanes at `held_depth` wait for `release`."""

    def __init__(self, engine, held_depth: int) -> None:
        super().__init__(engine)
        self.held_depth, self.release = held_depth, threading.Event()
        self.holding = threading.Event()

    def readout(self, lanes):
        if any(lane.depth == self.held_depth for lane in lanes):
            self.holding.set()
            assert self.release.wait(30), "the test never released the long block"
        return super().readout(lanes)


async def test_long_blocks_never_hold_every_execution(engine, captured):
    """Two long blocks and short ones with two execution slots: the long blocks' parts go
    one at a time, so while one is held the short blocks are read through the other slot;
    every answer is the same as alone once the long ones go on."""
    held = Held(engine, held_depth=64)
    longs = [lanes_of(captured[i : i + 1], [64] * 3) for i in range(2)]
    shorts = [lanes_of(captured[i : i + 1], [16 + i]) for i in range(4)]  # one a cohort
    with ThreadPoolExecutor(3) as pool:
        async with ReadoutCohorts(
            held, pool, max_lanes=8, concurrency=2, part_positions=64
        ) as cohorts:
            long_reads = [asyncio.ensure_future(cohorts.read(b)) for b in longs]
            await asyncio.to_thread(held.holding.wait, 10)
            short_outs = await asyncio.wait_for(
                asyncio.gather(*(cohorts.read(b) for b in shorts)), 30
            )
            assert not any(r.done() for r in long_reads)  # held, while the short ones went
            held.release.set()
            long_outs = await asyncio.gather(*long_reads)
    for (results, _), block in zip(short_outs + long_outs, shorts + longs, strict=True):
        assert results == engine.readout(block)
    assert held.calls.count(1) >= 6 and 3 not in held.calls  # the long ones a lane a part


async def test_the_reference_engine_reads_the_same_in_company_with_threaded_matmuls(
    reference, served
):
    """Blocks of one prompt length and depth, read while the CPU's matrix products run on
    two threads: each answer, margins and all, is the block's alone. (BLAS sums a product
    of 40 rows otherwise than one of 10, so one execution over four blocks would not be.)"""
    prompts = ["copy: abcdef", "copy: hijklm", "sort: qwerty", "add: 12+456"]
    blocks = [lanes_of([served.prompt_rows(p)], [64]) for p in prompts]
    assert len({b[0].rows.shape[0] for b in blocks}) == 1  # one length: one cohort key
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = [reference.readout(b) for b in blocks]
        outs = await read_all(Counting(reference), blocks, max_lanes=8)
    finally:
        torch.set_num_threads(threads)
    assert [results for results, _ in outs] == alone


@pytest.mark.parametrize("overlap", [3, 1])
async def test_a_cohort_starts_beside_a_running_one_only_when_full(engine, captured, overlap):
    """Two execution slots. While one cohort's execution runs (held), the next starts only
    with `overlap_lanes` lanes queued, or once the running one ends; with 1, every cohort
    starts at once. A block that finds nothing running never waits. Every answer is the
    block's alone. (`calls` counts an execution once it has run, the held one last.)"""
    held = Held(engine, held_depth=64)
    first = lanes_of(captured[:1], [64])
    short = lanes_of(captured[:1], [16])  # one cohort key: they may go together
    with ThreadPoolExecutor(3) as pool:
        async with ReadoutCohorts(
            held, pool, max_lanes=8, concurrency=2, overlap_lanes=overlap
        ) as cohorts:
            reads = [asyncio.ensure_future(cohorts.read(first))]
            await asyncio.to_thread(held.holding.wait, 10)  # nothing ran: it went at once
            for n in (1, 2):
                reads.append(asyncio.ensure_future(cohorts.read(short)))
                if overlap == 1:  # each goes as it comes, beside the held one
                    await until(lambda n=n: held.calls == [1] * n, f"{n} executions", 10.0)
                else:  # one execution running and fewer lanes queued than 3: they wait
                    await asyncio.sleep(0.2)
                    assert held.calls == []
            reads.append(asyncio.ensure_future(cohorts.read(short)))
            await until(
                lambda: held.calls == ([1, 1, 1] if overlap == 1 else [3]), "the third", 10.0
            )
            reads.append(asyncio.ensure_future(cohorts.read(short)))
            if overlap == 1:
                await until(lambda: held.calls == [1, 1, 1, 1], "the fourth", 10.0)
            else:  # the 3-lane execution is over and the held one runs: one lane waits
                await asyncio.sleep(0.2)
                assert held.calls == [3] and not reads[4].done()
            assert not reads[0].done()
            held.release.set()
            outs = await asyncio.wait_for(asyncio.gather(*reads), 30)
    for (results, _), block in zip(outs, [first, short, short, short, short], strict=True):
        assert results == engine.readout(block)
    assert held.calls == ([1] * 5 if overlap == 1 else [3, 1, 1])


async def test_parts_on_an_engine_of_their_own_take_no_slot(engine, captured):
    """One execution slot. A long block's part held on the engine's `beside()` view leaves
    the slot to the cohorts: short blocks are read while it waits (on a shared engine they
    would wait for it), and every answer is the block's alone."""
    held = Held(engine.beside(), held_depth=64)
    long = lanes_of(captured[:1], [64] * 3)
    shorts = [lanes_of(captured[i : i + 1], [16 + i]) for i in range(3)]
    with ThreadPoolExecutor(2) as pool:
        async with ReadoutCohorts(
            engine, pool, max_lanes=8, concurrency=1, part_positions=64, long_engine=held
        ) as cohorts:
            long_read = asyncio.ensure_future(cohorts.read(long))
            await asyncio.to_thread(held.holding.wait, 10)
            short_outs = await asyncio.wait_for(
                asyncio.gather(*(cohorts.read(b) for b in shorts)), 30
            )
            assert not long_read.done()
            held.release.set()
            long_out = await asyncio.wait_for(long_read, 30)
    for (results, _), block in zip([*short_outs, long_out], [*shorts, long], strict=True):
        assert results == engine.readout(block)
    assert held.calls == [1, 1, 1]  # every part on the view, a lane a part
