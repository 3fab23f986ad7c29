"""Concurrent requests -> one packed base forward per cohort.

Requests queued while the previous forward ran (or within an optional window) are grouped
by padded-length bucket and run as cohorts of at most K_max lanes, one forward each, on a
single forward thread. Lanes are
right-padded to a power-of-two bucket with at least one pad column, whatever the cohort:
a lane's rows then come out of the same computation alone or batched (the kernels see the
same padded width and the same masked attention path), so batching never changes an
answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import structlog
import torch
from torch import nn

from capture_svc.registry import CapturePlan, CaptureRegistry, CohortStamp, Slot
from stateblock.capture import capture

log = structlog.get_logger("capture_svc.batcher")
MIN_BUCKET = 16


def bucket_width(length: int) -> int:
    """Smallest power of two (>= MIN_BUCKET) strictly above length: one pad column at least."""
    width = MIN_BUCKET
    while width <= length:
        width *= 2
    return width


@dataclass
class Pending:
    plan: CapturePlan
    lane_ids: Sequence[Sequence[int]]
    future: asyncio.Future = field(repr=False)

    @property
    def bucket(self) -> int:
        return bucket_width(max(len(ids) for ids in self.lane_ids))


class CohortForward:
    """One forward over a cohort; the hook hands the rows to the registry, stamped."""

    def __init__(
        self, model: nn.Module, registry: CaptureRegistry, *, pad_id: int, capture_mode: int
    ) -> None:
        self._model = model
        self._registry = registry
        self._pad_id = pad_id
        self._mode = capture_mode
        self._device = next(model.parameters()).device

    def warm_up(self) -> None:
        """One throwaway forward at start-up, so the first request pays no first-call cost."""
        ids = torch.full((1, MIN_BUCKET), self._pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        mask[0, :2] = 1
        capture(self._model, ids.to(self._device), mask.to(self._device))

    def __call__(self, cohort: Sequence[Pending]) -> None:
        width = max(p.bucket for p in cohort)
        slots: list[Slot] = []
        lanes: list[Sequence[int]] = []
        for p in cohort:
            for i, ids in enumerate(p.lane_ids):
                slots.append(Slot(p.plan.request_id, p.plan.token, i, len(lanes)))
                lanes.append(ids)
        ids = torch.full((len(lanes), width), self._pad_id, dtype=torch.long)  # (B, P)
        mask = torch.zeros_like(ids)
        for row, lane in enumerate(lanes):
            ids[row, : len(lane)] = torch.tensor(lane, dtype=torch.long)
            mask[row, : len(lane)] = 1
        lengths = mask.sum(dim=1).tolist()  # what the forward attends to, per batch row
        stamp = CohortStamp(tuple(slots), self._mode)
        capture(
            self._model,
            ids.to(self._device),
            mask.to(self._device),
            on_rows=lambda rows: self._registry.record(stamp, rows, lengths),
        )


class ForwardBatcher:
    """`submit` resolves once the forward that carried the request has recorded its rows."""

    def __init__(
        self,
        forward: Callable[[Sequence[Pending]], None],
        executor: Executor,
        *,
        window_s: float,
        max_lanes: int,
        on_cohort: Callable[[int], None] | None = None,
    ) -> None:
        self._forward = forward
        self._executor = executor
        self._window = window_s
        self._max_lanes = max_lanes
        self._on_cohort = on_cohort
        self._queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> ForwardBatcher:
        self._task = asyncio.create_task(self._run(), name="capture-batcher")
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        while not self._queue.empty():
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(RuntimeError("capture service is shutting down"))

    async def submit(self, plan: CapturePlan, lane_ids: Sequence[Sequence[int]]) -> None:
        if len(lane_ids) > self._max_lanes:
            raise ValueError(f"{len(lane_ids)} lanes exceed the cohort limit {self._max_lanes}")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(Pending(plan, lane_ids, future))
        await future

    async def _collect(self) -> list[Pending]:
        """The next batch. With no window (the default) nothing waits: the first request
        goes at once, together with whatever queued up meanwhile, which under load is
        everything that arrived while the previous forward ran (continuous batching). A
        window > 0 trades that much latency for fuller cohorts at low load."""
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        await asyncio.sleep(0)  # requests submitted in the same loop turn join this batch
        deadline = loop.time() + self._window
        while sum(len(p.lane_ids) for p in batch) < self._max_lanes:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return [p for p in batch if not p.future.done()]  # cancelled callers drop out

    def _cohorts(self, batch: list[Pending]) -> list[list[Pending]]:
        by_bucket: dict[int, list[Pending]] = {}
        for p in batch:
            by_bucket.setdefault(p.bucket, []).append(p)
        cohorts: list[list[Pending]] = []
        for group in by_bucket.values():
            current: list[Pending] = []
            for p in group:
                if current and sum(len(q.lane_ids) for q in current) + len(p.lane_ids) > (
                    self._max_lanes
                ):
                    cohorts.append(current)
                    current = []
                current.append(p)
            cohorts.append(current)
        return cohorts

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            for cohort in self._cohorts(batch):
                try:
                    await loop.run_in_executor(self._executor, self._forward, cohort)
                except Exception as e:  # the forward failed: every request in it fails
                    log.exception("cohort forward failed", lanes=len(cohort))
                    for p in cohort:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                if self._on_cohort is not None:
                    self._on_cohort(sum(len(p.lane_ids) for p in cohort))
                for p in cohort:
                    if not p.future.done():
                        p.future.set_result(None)
