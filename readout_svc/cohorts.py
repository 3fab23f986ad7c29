"""The blocks a process's worker tasks hold at once -> one engine execution per cohort.

Each worker task reads one block at a time; under load a process holds several (one per
task), and reading them one engine call each leaves the device running one small lane at a
time. `ReadoutCohorts` queues every task's lanes and runs whatever queued while the previous
executions ran as one execution, at most `max_lanes` lanes (the engine's K_max, which every
engine reads in one enqueue), as the capture's batcher does for forwards.

A request's answer must not depend on its company. Lanes are combined only when the engine
says they read the same way together as alone: its `cohort_key(lanes)` (the precision path
and depth bucket a block's lanes run at) must be equal for every block of a cohort, and an
engine without one is never combined. A cohort whose execution raises is read again block
by block, so one bad block fails only its own request.
"""

from __future__ import annotations

import asyncio
import time
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


class ReadoutCohorts:
    """`read(lanes)` -> (the lanes' results, the seconds of the execution that read them).
    At most `concurrency` executions run at once (the executor's threads); blocks that
    arrive meanwhile wait and are read together."""

    def __init__(
        self,
        engine: ReadoutEngine,
        executor: Executor,
        *,
        max_lanes: int,
        concurrency: int = 1,
        on_cohort=None,  # Callable[[int], None]: blocks per execution, for a histogram
    ) -> None:
        self._engine = engine
        self._executor = executor
        self._max_lanes = max_lanes
        self._slots = asyncio.Semaphore(concurrency)
        self._on_cohort = on_cohort
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    async def __aenter__(self) -> ReadoutCohorts:
        self._task = asyncio.create_task(self._run(), name="readout-cohorts")
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        why = "readout cohorts are shutting down"
        await runtime.stop_serving(self._task, self._queue, why, *self._running)

    async def read(self, lanes: Sequence[LaneRequest]) -> tuple[list[LaneResult], float]:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Queued(lanes, cohort_key(self._engine, lanes), future))
        return await future

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()  # while every slot runs, blocks queue up together
            try:
                batch = [await self._queue.get()]
            except BaseException:
                self._slots.release()
                raise
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            cohorts = self.cohorts([q for q in batch if not q.future.done()])
            for i, cohort in enumerate(cohorts):
                if i:  # the first cohort holds the slot acquired above
                    await self._slots.acquire()
                task = asyncio.create_task(self._execute(cohort))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            if not cohorts:
                self._slots.release()

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

    async def _execute(self, cohort: list[_Queued]) -> None:
        try:
            await self._read(cohort)
        finally:
            self._slots.release()

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
