"""Concurrent requests -> one packed base forward per cohort.

Requests queued while the previous forward ran (or within an optional window) are grouped
by padded-length bucket and run as cohorts bounded by lanes and by padded tokens (lanes x
the bucket width, `CohortLimits`), one forward each, the narrowest bucket first.

A request's identical lanes (`n` > 1 of one prompt, each lane with its own seed) go forward
as one: the plan table fills each of them from that lane's rows, which are the same whatever
the company (below), so `n` costs the capture nothing.

A request over the token bound (a maximal one: 8 lanes of 4,096 tokens) is captured in
parts instead, as many of its lanes a forward as the bound allows (one lane when a single
lane is over it), by a second runner beside the cohorts': its parts never hold up the
cohorts of the requests that fit. With an executor of more threads than forwards in flight
a part runs beside a cohort; with one (a forward replaying CUDA graphs: they belong to the
thread that recorded them) the two runners take turns, so a request queued behind a part
goes in the next forward. The cohorts' runner keeps up to `in_flight` forwards going
(`STATEBLOCK_CAPTURE_FORWARDS`, each on a thread and CUDA stream of its own),
so with two the device runs the next cohort while the last one's rows are copied out and its
callers answered. Parts of several such requests go round-robin, one part of each in turn;
the plan table assembles a request's rows once its last lane is in. On a GPU the parts run
on streams of the lowest priority and the cohorts on streams of the highest: a part's
kernels fill the device only where a cohort's leave room, so a small request beside a
maximal one waits for the blocks already running, not for the part's whole forward.
A kernel in flight is not preempted, though: with `part_yield_s`
(`STATEBLOCK_CAPTURE_PART_YIELD_S`) a part does not start while cohort forwards run or wait,
for up to that long a part, so a small request's forward has the device to itself but for a
part already running, and with `CohortLimits.part_chunk` (`STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS`)
a long lane is captured a chunk of positions a turn (`stateblock.model.chunked`), so that
part is short (docs/BENCHMARKS.md has the small requests' latency beside each).

Lanes are right-padded to a bucket width (powers of two and 1.5x
powers of two) and the forward runs without an attention mask: the base models are causal
decoder-only (Llama; NemotronH attention and Mamba conv/scan), so with right padding no
valid position sees a pad column, and the pad rows are dropped. A mask would only push
Hugging Face SDPA off its causal (flash) kernel onto a materialized (B, 1, P, P) mask. A
lane's rows then come out of the same computation alone or batched (the same bucket width,
the same unmasked causal path), so batching never changes an answer.

A forward that replays CUDA graphs runs a fixed set of shapes: a cohort's lanes are padded
up to a lane bucket with dummy lanes of pad ids (their rows are cut off before the plan
table sees the forward's output, so they reach no block), and `warm_shapes` lists every
(lane bucket, width bucket) pair a cohort can reach, which the service runs through the
forward before it is ready. A compiled forward without graphs has symbolic lanes: one graph
serves every lane count, so a cohort runs at its own count and the warm-up's buckets only
compile it. Either way a compiled forward runs at least two lanes by default: one lane alone
would run a graph of its own (dynamo specializes sizes of 1), so a request alone would not
get its rows in company.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import structlog

from capture_svc.config import CohortLimits
from capture_svc.plans import CapturePlan, distinct
from stateblock import runtime

log = structlog.get_logger("capture_svc.batcher")
MIN_BUCKET = 16


def bucket_width(length: int) -> int:
    """Smallest width >= length in 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x).

    The 1.5x steps cap the padding at a third of the width (a plain power-of-two series
    wastes up to half the prefill), while keeping few shapes to compile.
    """
    width = MIN_BUCKET
    while True:
        for candidate in (width, width * 3 // 2):
            if candidate >= length:
                return candidate
        width *= 2


def width_buckets(prompt_len_max: int) -> list[int]:
    """Every width a cohort can be padded to when prompts are at most prompt_len_max."""
    widths = [MIN_BUCKET]
    while widths[-1] < prompt_len_max:
        widths.append(bucket_width(widths[-1] + 1))
    return widths


def lane_bucket(lanes: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= lanes; buckets are sorted and end at the cohort limit."""
    for bucket in buckets:
        if bucket >= lanes:
            return bucket
    raise ValueError(f"{lanes} lanes exceed the largest lane bucket {buckets[-1]}")


def warm_shapes(
    lane_buckets: Sequence[int], prompt_len_max: int, cohort: CohortLimits | None = None
) -> list[tuple[int, int]]:
    """Every (lanes, width) shape a compiled cohort forward can run: with cohort limits, a
    width's lane buckets stop at the one that holds the most lanes a forward that wide can
    carry (a request over them goes in parts), so wide prompts add few shapes."""
    shapes = []
    for width in width_buckets(prompt_len_max):
        top = lane_buckets[-1]
        if cohort is not None:
            top = lane_bucket(cohort.lanes_at(width), lane_buckets)
        shapes += [(n, width) for n in lane_buckets if n <= top]
    return shapes


class Dropped(Exception):
    """The request was taken back (`ForwardBatcher.drop`) before its forward started."""


@dataclass
class ForwardTiming:
    """Where a request's time in the batcher went: `waited`, from its submit until its first
    forward began on an executor thread (behind other forwards, or for a thread); `ran`, its
    forwards' time on their threads (a part's each, summed)."""

    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    ran: float = 0.0

    @property
    def waited(self) -> float:
        return 0.0 if self.started is None else self.started - self.submitted

    def forward(self, started: float, seconds: float) -> None:
        self.started = started if self.started is None else self.started
        self.ran += seconds


@dataclass
class Pending:
    """Lanes of one request for a forward: all of them, or a part (lanes `first_lane` on).
    With `groups`, lane_ids are the request's distinct lanes and groups[k] the lane indices
    lane_ids[k] fills."""

    plan: CapturePlan
    lane_ids: Sequence[Sequence[int]]
    future: asyncio.Future = field(repr=False)
    first_lane: int = 0
    timing: ForwardTiming = field(default_factory=ForwardTiming, repr=False)  # its parts' too
    progress: Any = field(default=None, repr=False)  # a part's chunks run so far (ChunkedLane)
    groups: Sequence[tuple[int, ...]] | None = None

    @property
    def bucket(self) -> int:
        return bucket_width(max(len(ids) for ids in self.lane_ids))

    def indices(self) -> Sequence[tuple[int, ...]]:
        """The lane indices each of lane_ids fills."""
        if self.groups is not None:
            return self.groups
        return [(self.first_lane + k,) for k in range(len(self.lane_ids))]

    def parts(self, lanes: int) -> list[Pending]:
        """This request as parts of at most `lanes` lanes (at least one), in lane order."""
        step, groups = max(1, lanes), self.indices()
        return [
            Pending(
                self.plan,
                self.lane_ids[i : i + step],
                self.future,
                groups[i][0],
                self.timing,
                groups=groups[i : i + step],
            )
            for i in range(0, len(self.lane_ids), step)
        ]


class ForwardBatcher:
    """`submit` resolves once the forwards that carried the request have recorded its rows.

    Two runners share the executor: cohorts of the requests that fit the token bound, and
    the parts of those over it (module docstring)."""

    def __init__(
        self,
        forward: Callable[[Sequence[Pending]], None],
        executor: Executor,
        *,
        window_s: float,
        max_lanes: int,
        cohort: CohortLimits | None = None,
        on_cohort: Callable[[int], None] | None = None,
        in_flight: int = 1,
        forward_part: Callable[[Sequence[Pending]], bool | None] | None = None,
        part_yield_s: float = 0.0,
    ) -> None:
        self._forward = forward
        self._part_yield = part_yield_s  # a part waits this long at most for busy cohorts
        self._cohorts_idle = asyncio.Event()  # set whenever no cohort forward runs or waits
        self._forward_part = forward_part or forward  # a part of a request over the bound
        self._executor = executor
        # cohort forwards at once: with two, the next cohort's forward runs on the device
        # while the previous one's rows go out to the host and its callers are answered
        self._in_flight = in_flight
        self._forwards: set[asyncio.Task] = set()  # cohort forwards running
        self._collected: deque[list[Pending]] = deque()  # cohorts waiting for a forward
        self._window = window_s
        self._max_lanes = max_lanes  # one request's
        # one forward's; by default one request's lanes and no token bound
        self._cohort = cohort or CohortLimits(max_lanes, 1 << 62)
        self._on_cohort = on_cohort
        self._queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._oversized: asyncio.Queue[Pending] = asyncio.Queue()  # over the token bound
        # requests over the token bound being captured: each one's parts still to run
        self._rotation: deque[list[Pending]] = deque()
        self._tasks: list[asyncio.Task] = []
        # submitted, no forward started: what `drop` can still take back, by request id
        self._unstarted: dict[str, Pending] = {}

    async def __aenter__(self) -> ForwardBatcher:
        self._tasks = [
            asyncio.create_task(self._run(), name="capture-batcher"),
            asyncio.create_task(self._run_parts(), name="capture-parts"),
        ]
        return self

    async def __aexit__(self, *exc) -> None:
        def waiting() -> list[Pending]:
            parted = [parts[0] for parts in self._rotation if parts]
            collected = [p for cohort in self._collected for p in cohort]
            return (
                parted + collected + runtime.drained(self._queue) + runtime.drained(self._oversized)
            )

        await runtime.stop_serving(
            self._tasks, "capture service is shutting down", waiting, *self._forwards
        )

    def over_bound(self, lane_ids: Sequence[Sequence[int]]) -> bool:
        """Whether a request's distinct lanes at its bucket width are over the cohort's token
        bound, or one is long enough to run in chunks: it is captured in parts."""
        return self._over_bound(distinct(lane_ids)[0])

    def _over_bound(self, unique: Sequence[Sequence[int]]) -> bool:
        """`over_bound` of a request's distinct lanes."""
        longest = max(len(ids) for ids in unique)
        return len(unique) * bucket_width(longest) > self._cohort.tokens or (
            self._cohort.chunked(longest)
        )

    async def submit(self, plan: CapturePlan, lane_ids: Sequence[Sequence[int]]) -> ForwardTiming:
        """Resolves once the forwards that carried the request have recorded its rows."""
        if len(lane_ids) > self._max_lanes:
            raise ValueError(
                f"{len(lane_ids)} lanes exceed the per-request limit {self._max_lanes}"
            )
        future = asyncio.get_running_loop().create_future()
        unique, groups = distinct(lane_ids)
        if len(unique) < len(lane_ids):  # one forward lane for each distinct prompt
            pending = Pending(plan, unique, future, groups=groups)
        else:
            pending = Pending(plan, lane_ids, future)
        self._unstarted[plan.request_id] = pending
        try:
            await (self._oversized if self._over_bound(unique) else self._queue).put(pending)
            await future
        finally:
            self._unstarted.pop(plan.request_id, None)
        return pending.timing

    def drop(self, request_id: str) -> bool:
        """Take back a request whose forward has not started: its `submit` raises Dropped
        and nothing of it is ever forwarded. False once its forward started (or for an
        unknown id): then its `submit` ends as the forward does."""
        pending = self._unstarted.pop(request_id, None)
        if pending is None or pending.future.done():
            return False
        pending.future.set_exception(Dropped(f"request {request_id} dropped before its forward"))
        return True

    async def _collect(self) -> list[Pending]:
        """The next batch. With no window (the default) nothing waits: the first request
        goes at once, together with whatever queued up meanwhile, which under load is
        everything that arrived while the previous forward ran (continuous batching). A
        window > 0 trades that much latency for fuller cohorts at low load."""
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        await asyncio.sleep(0)  # requests submitted in the same loop turn join this batch
        deadline = loop.time() + self._window
        while sum(len(p.lane_ids) for p in batch) < self._cohort.lanes:
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
        """The batch split into forwards: by bucket width, narrowest first (short prompts are
        not held behind long ones), each within the cohort's lanes and padded tokens."""
        by_bucket: dict[int, list[Pending]] = {}
        for p in batch:
            by_bucket.setdefault(p.bucket, []).append(p)
        cohorts: list[list[Pending]] = []
        for width in sorted(by_bucket):
            current: list[Pending] = []
            lanes = 0
            for p in by_bucket[width]:
                more = lanes + len(p.lane_ids)
                if current and (more > self._cohort.lanes or more * width > self._cohort.tokens):
                    cohorts.append(current)
                    current, lanes, more = [], 0, len(p.lane_ids)
                current.append(p)
                lanes = more
            cohorts.append(current)
        return cohorts

    async def _run(self) -> None:
        """The requests that fit the token bound, a batch at a time, a cohort a forward, up
        to `in_flight` forwards at once. A batch is collected only once a forward can start,
        so it takes in everything that queued while the others ran."""
        free = asyncio.Semaphore(self._in_flight)
        while True:
            await free.acquire()
            held = True
            self._collected = deque(self._cohorts(await self._collect()))
            while self._collected:
                if not held:
                    await free.acquire()
                held = False
                # a caller that went away while an earlier cohort ran: its forward never starts
                cohort = [p for p in self._collected.popleft() if not p.future.done()]
                task = asyncio.create_task(self._run_cohort(cohort), name="capture-cohort")
                self._forwards.add(task)
                task.add_done_callback(self._forwards.discard)
                task.add_done_callback(lambda _: free.release())
                task.add_done_callback(lambda _: self._wake_parts())
            if held:
                free.release()

    async def _run_cohort(self, cohort: list[Pending]) -> None:
        if cohort and await self._run_forward(cohort) is not None:
            for p in cohort:
                if not p.future.done():
                    p.future.set_result(None)

    def _cohorts_busy(self) -> bool:
        return bool(self._forwards or self._collected or not self._queue.empty())

    def _wake_parts(self) -> None:
        if not self._cohorts_busy():
            self._cohorts_idle.set()

    async def _yield_to_cohorts(self) -> None:
        """With part_yield_s, wait while cohort forwards run or wait, up to that long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._part_yield
        while self._cohorts_busy() and (left := deadline - loop.time()) > 0:
            self._cohorts_idle.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._cohorts_idle.wait(), left)

    async def _run_parts(self) -> None:
        """The requests over the token bound, a part a forward, one part of each in turn. A
        part run in chunks (`CohortForward.part`) takes a turn a chunk. A request whose caller
        went away (or that failed) runs none of its remaining parts."""
        while True:
            if not self._rotation:
                self._rotation.append(self._split(await self._oversized.get()))
            while not self._oversized.empty():
                self._rotation.append(self._split(self._oversized.get_nowait()))
            if self._part_yield > 0:
                await self._yield_to_cohorts()
            parts = self._rotation[0]  # kept there while it runs: a stop fails its caller
            part = parts[0]
            ran = None if part.future.done() else await self._run_forward([part], part=True)
            self._rotation.popleft()
            if ran is False:  # chunks of this part remain: its next turn runs the next one
                self._rotation.append(parts)
                continue
            del parts[0]
            if ran is None:
                continue
            if parts:
                self._rotation.append(parts)
            elif not part.future.done():
                part.future.set_result(None)

    def _split(self, pending: Pending) -> list[Pending]:
        return pending.parts(self._cohort.part_lanes_at(pending.bucket))

    async def _run_forward(self, cohort: list[Pending], *, part: bool = False) -> bool | None:
        """One forward on the executor (a part's through `forward_part`): None when it failed
        (its requests' futures then carry the error), False when a part's chunks remain,
        True once done."""
        for p in cohort:  # from here on `drop` cannot take it back
            self._unstarted.pop(p.plan.request_id, None)
        forward = self._forward_part if part else self._forward

        def timed() -> tuple[float, float, object]:
            started = time.perf_counter()
            done = forward(cohort)
            return started, time.perf_counter() - started, done

        try:
            started, seconds, done = await asyncio.get_running_loop().run_in_executor(
                self._executor, timed
            )
        except Exception as e:  # the forward failed: every request in it fails
            log.exception("cohort forward failed", lanes=sum(len(p.lane_ids) for p in cohort))
            for p in cohort:
                if not p.future.done():
                    p.future.set_exception(e)
            return None
        for p in cohort:
            p.timing.forward(started, seconds)
        if done is False:
            return False
        if self._on_cohort is not None:
            self._on_cohort(sum(len(p.lane_ids) for p in cohort))
        return True
