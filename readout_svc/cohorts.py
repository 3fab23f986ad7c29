"""The blocks a process's worker tasks hold at once -> one engine execution per cohort.

Each worker task reads one block at a time; under load a process holds several (one per
task), and reading them one engine call each leaves the device running one small lane at a
time. `ReadoutCohorts` queues every task's lanes and runs whatever queued while the previous
executions ran as one execution, at most `max_lanes` lanes (the engine's K_max, which every
engine reads in one enqueue), as the capture's batcher does for forwards. Beside a running
execution another starts only with `overlap_lanes` lanes in hand (`_filled_or_idle`).

A request's answer must not depend on its company. Lanes are combined only when the engine
says they read the same way together as alone: its `cohort_key(lanes)` (the precision path
and depth bucket a block's lanes run at) must be equal for every block of a cohort, and an
engine without one is never combined. A cohort whose execution raises is read again block
by block, so one bad block fails only its own request.

A long block (more answer positions than `part_positions`, one maximal lane's: a maximal
request's 8 lanes of 8,192) never holds every execution: a runner of its own reads long
blocks one execution at a time, beside the cohorts, one part of each in turn. A part is as
many of the block's lanes as fit `part_positions` (one at least), and a block is read in
parts only when each part has the whole block's `cohort_key` (it then reads the same apart
as together); otherwise it is read whole, still by that runner. Its caller gets the
block's results once its last part is read. With `long_engine` (an engine's `beside()`: the
same weights with its own graphs, lock and a low-priority stream) the parts are read on it
and take no execution slot, so a cohort never waits for a part's execution to end; without
one, a part holds one of the slots as a cohort's execution does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import structlog

from stateblock import runtime
from stateblock.engines.base import LaneRequest, LaneResult, ReadoutEngine

log = structlog.get_logger("readout_svc.cohorts")


def cohort_key(engine: ReadoutEngine, lanes: Sequence[LaneRequest]) -> Hashable | None:
    """What a block must share with the others of a cohort; None: read it alone."""
    key = getattr(engine, "cohort_key", None)
    return None if key is None else key(lanes)


@dataclass
class _Queued:
    lanes: Sequence[LaneRequest]
    key: Hashable | None
    future: asyncio.Future = field(repr=False)


@dataclass
class _Long:
    """A long block being read: its parts still to read, the results of those read."""

    queued: _Queued
    parts: list[Sequence[LaneRequest]]
    results: list[LaneResult] = field(default_factory=list)
    seconds: float = 0.0


def _timed(engine: ReadoutEngine, lanes: Sequence[LaneRequest]) -> tuple[list[LaneResult], float]:
    t0 = time.perf_counter()
    results = engine.readout(lanes)
    return results, time.perf_counter() - t0


class DirectReadouts:
    """One engine execution per block (a cohort of one), on the executor."""

    def __init__(self, engine: ReadoutEngine, executor: Executor) -> None:
        self._engine, self._executor = engine, executor

    async def read(self, lanes: Sequence[LaneRequest]) -> tuple[list[LaneResult], float]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _timed, self._engine, lanes)

    def is_long(self, lanes: Sequence[LaneRequest]) -> bool:
        return False  # every block is read as it comes


class ReadoutCohorts:
    """`read(lanes)` -> (the lanes' results, the seconds of the executions that read them).
    At most `concurrency` executions run at once (the executor's threads), one of them at
    most a long block's part, or that part beside them on a `long_engine` (module
    docstring); blocks that arrive meanwhile wait and are read together."""

    def __init__(
        self,
        engine: ReadoutEngine,
        executor: Executor,
        *,
        max_lanes: int,
        concurrency: int = 1,
        overlap_lanes: int | None = None,  # None: max_lanes
        part_positions: int | None = None,  # None: no block is long
        long_engine: ReadoutEngine | None = None,  # None: parts read on `engine`
        on_cohort=None,  # Callable[[int], None]: blocks per execution, for a histogram
    ) -> None:
        self._engine = engine
        self._executor = executor
        self._max_lanes = max_lanes
        self._overlap_lanes = max_lanes if overlap_lanes is None else overlap_lanes
        self._part_positions = part_positions
        self._slots = asyncio.Semaphore(concurrency)
        self._long_engine = long_engine or engine
        # what a part holds while it reads: an execution slot on the cohorts' engine;
        # nothing on an engine of its own (its runner reads one part at a time)
        own = long_engine is not None and long_engine is not engine
        self._part_slot = contextlib.nullcontext() if own else self._slots
        self._on_cohort = on_cohort
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._queued_lanes = 0  # the lanes of the blocks in _queue
        self._wake = asyncio.Event()  # a block queued, or a cohort's execution ended
        self._long: asyncio.Queue[_Long] = asyncio.Queue()
        self._rotation: deque[_Long] = deque()  # long blocks being read, in turn
        self._tasks: list[asyncio.Task] = []
        self._running: set[asyncio.Task] = set()

    async def __aenter__(self) -> ReadoutCohorts:
        self._tasks = [
            asyncio.create_task(self._run(), name="readout-cohorts"),
            asyncio.create_task(self._run_long(), name="readout-long"),
        ]
        return self

    async def __aexit__(self, *exc) -> None:
        def waiting() -> list[_Queued]:
            long = [b.queued for b in self._rotation]
            long += [b.queued for b in runtime.drained(self._long)]
            return long + runtime.drained(self._queue)

        why = "readout cohorts are shutting down"
        await runtime.stop_serving(self._tasks, why, waiting, *self._running)

    async def read(self, lanes: Sequence[LaneRequest]) -> tuple[list[LaneResult], float]:
        future = asyncio.get_running_loop().create_future()
        queued = _Queued(lanes, cohort_key(self._engine, lanes), future)
        if self.is_long(lanes):
            await self._long.put(_Long(queued, self.parts(queued)))
        else:
            self._queued_lanes += len(lanes)
            await self._queue.put(queued)
            self._wake.set()
        return await future

    def is_long(self, lanes: Sequence[LaneRequest]) -> bool:
        """More answer positions than one part carries."""
        budget = self._part_positions
        return budget is not None and sum(lane.depth for lane in lanes) > budget

    def parts(self, queued: _Queued) -> list[Sequence[LaneRequest]]:
        """A long block's parts: its lanes in order, as many an execution as fit
        `part_positions` (one at least); the whole block as one part unless every part has
        its cohort key (an engine without one: never in parts)."""
        assert self._part_positions is not None
        if queued.key is None:
            return [queued.lanes]
        parts: list[list[LaneRequest]] = []
        positions = 0
        for lane in queued.lanes:
            if not parts or positions + lane.depth > self._part_positions:
                parts.append([])
                positions = 0
            parts[-1].append(lane)
            positions += lane.depth
        if any(cohort_key(self._engine, part) != queued.key for part in parts):
            return [queued.lanes]
        return list(parts)

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            try:  # while every slot runs, blocks queue up together
                await self._slots.acquire()
                try:
                    await self._filled_or_idle()
                except BaseException:
                    self._slots.release()
                    raise
            except BaseException:
                self._queue.put_nowait(first)  # a stop fails its caller
                raise
            batch = [first]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._queued_lanes -= sum(len(q.lanes) for q in batch)
            cohorts = self.cohorts([q for q in batch if not q.future.done()])
            for i, cohort in enumerate(cohorts):
                if i:  # the first cohort holds the slot acquired above
                    await self._slots.acquire()
                task = asyncio.create_task(self._execute(cohort))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            if not cohorts:
                self._slots.release()

    async def _run_long(self) -> None:
        """Long blocks, one execution at a time, one part of each in turn. A block whose
        caller went away (or whose part failed) reads none of its remaining parts."""
        while True:
            if not self._rotation:
                self._rotation.append(await self._long.get())
            while not self._long.empty():
                self._rotation.append(self._long.get_nowait())
            block = self._rotation[0]  # kept there while it reads: a stop fails its caller
            async with self._part_slot:
                going = not block.queued.future.done() and await self._read_part(block)
            self._rotation.popleft()
            if going and block.parts:
                self._rotation.append(block)
            elif going:
                block.queued.future.set_result((block.results, block.seconds))

    async def _read_part(self, block: _Long) -> bool:
        """Read the block's next part; False when it failed (the block's caller then has
        the error) or its caller went away meanwhile."""
        part = block.parts.pop(0)
        loop = asyncio.get_running_loop()
        try:
            results, seconds = await loop.run_in_executor(
                self._executor, _timed, self._long_engine, part
            )
        except Exception as e:
            if not block.queued.future.done():
                block.queued.future.set_exception(e)
            return False
        if self._on_cohort is not None:
            self._on_cohort(1)
        block.results += results
        block.seconds += seconds
        return not block.queued.future.done()

    def cohorts(self, batch: list[_Queued]) -> list[list[_Queued]]:
        """The batch split into executions: blocks of one key together, up to max_lanes
        lanes each; blocks with no key one each."""
        by_key: dict[Hashable, list[_Queued]] = {}
        out: list[list[_Queued]] = []
        for q in batch:
            if q.key is None:
                out.append([q])
            else:
                by_key.setdefault(q.key, []).append(q)
        for group in by_key.values():
            current: list[_Queued] = []
            lanes = 0
            for q in group:
                if current and lanes + len(q.lanes) > self._max_lanes:
                    out.append(current)
                    current, lanes = [], 0
                current.append(q)
                lanes += len(q.lanes)
            out.append(current)
        return out

    async def _filled_or_idle(self) -> None:
        """Returns at once while no cohort's execution runs; while one does, once the lanes
        of the blocks queued (the one taken first among them) reach `overlap_lanes` or it
        ends. An execution of a depth bucket runs its lanes whatever number came (the
        engine's fixed shape), so a second one beside a running one is worth starting full:
        under load the executions fill and each block costs less device time; alone, a
        block never waits. A long block's part is not counted: a cohort never waits for one."""
        while self._running and self._queued_lanes < self._overlap_lanes:
            self._wake.clear()
            await self._wake.wait()

    async def _execute(self, cohort: list[_Queued]) -> None:
        try:
            await self._read(cohort)
        finally:
            self._running.discard(asyncio.current_task())  # before the wake: it is over
            self._slots.release()
            self._wake.set()

    async def _read(self, cohort: list[_Queued]) -> None:
        """One execution of the cohort's lanes, each block's futures given its results; a
        cohort of several that raises is read again block by block."""
        lanes = [lane for q in cohort for lane in q.lanes]
        loop = asyncio.get_running_loop()
        try:
            results, seconds = await loop.run_in_executor(
                self._executor, _timed, self._engine, lanes
            )
        except Exception as e:
            if len(cohort) > 1:
                log.warning("cohort readout failed; reading its blocks one by one")
                for q in cohort:
                    await self._read([q])
                return
            if not cohort[0].future.done():
                cohort[0].future.set_exception(e)
            return
        if self._on_cohort is not None:
            self._on_cohort(len(cohort))
        at = 0
        for q in cohort:
            if not q.future.done():
                q.future.set_result((results[at : at + len(q.lanes)], seconds))
            at += len(q.lanes)
