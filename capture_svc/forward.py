"""The capture's base forward over one cohort (or a part of a request over the token bound):
the ids laid out, the forward run on this thread's CUDA stream, the rows handed to the plan
table stamped with the lanes they belong to. `capture_svc.batcher` decides what goes in
each forward; this module runs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import structlog
import torch
from torch import nn

from capture_svc.batcher import MIN_BUCKET, Pending, lane_bucket
from capture_svc.plans import CohortStamp, PlanTable, Slot
from stateblock.model.capture import capture, graphs_compiled, warm_up
from stateblock.model.chunked import ChunkedLane, ChunkRunner

log = structlog.get_logger("capture_svc.forward")


class CohortForward:
    """One forward over a cohort; the hook hands the rows to the plan table, stamped."""

    def __init__(
        self,
        model: nn.Module,
        plans: PlanTable,
        *,
        pad_id: int,
        capture_mode: int,
        lane_buckets: Sequence[int] | None = None,
        min_lanes: int = 1,
        thread_streams: bool = False,
        on_compile: Callable[[], object] | None = None,
        part_sms: int | None = None,
        part_chunk: int | None = None,
        part_chunk_len: int = 4096,
    ) -> None:
        self._model = model
        self._plans = plans
        self._pad_id = pad_id
        self._mode = capture_mode
        self._lane_buckets = lane_buckets  # None: a cohort runs at its own lane count,
        self._min_lanes = min_lanes  # ... padded with dummy lanes up to this one
        self._device = next(model.parameters()).device
        # Each forward thread on CUDA streams of its own (the eager forward's two threads):
        # on one stream a part's kernels, launched first, queue every cohort's behind them;
        # a part's stream is of the lowest priority, a cohort's of the highest.
        on_cuda = thread_streams and self._device.type == "cuda"
        self._streams = threading.local() if on_cuda else None
        # a part's kernels on this many SMs only (a green context), the rest the cohorts'
        self._part_sms = part_sms if on_cuda else None
        self._green: Any = None
        self._part_chunk = part_chunk  # a lane longer than this: captured a chunk a turn
        self._part_chunk_len = part_chunk_len  # ... and no longer than this
        self._chunks: ChunkRunner | None = None  # made (and on CUDA recorded) at the warm-up
        # compiled: graphs compiled so far, counted from the warm-up's end; a forward after it
        # that compiles (a shape the warm-up missed, a guard it broke) is reported
        self._on_compile = on_compile
        self._graphs: int | None = None
        self._graphs_lock = threading.Lock()

    def warm_up(
        self, shapes: Sequence[tuple[int, int]] = ((1, MIN_BUCKET),), runs: int = 1
    ) -> float:
        """Run each (lanes, width) shape `runs` times before the first request (by default one
        throwaway forward: the eager path's first-call cost); returns the seconds it took."""
        t0 = time.perf_counter()

        def done(lanes: int, width: int, seconds: float) -> None:
            log.info("warm-up shape", lanes=lanes, width=width, seconds=round(seconds, 3))

        warm_up(self._model, shapes, pad_id=self._pad_id, runs=runs, on_shape=done)
        if self._part_chunk is not None:  # the chunks' graphs recorded here, not on a request
            self._runner()  # (made, it has run each of its shapes once)
        if self._on_compile is not None:
            self._graphs = graphs_compiled()
        total = time.perf_counter() - t0
        log.info("warm-up done", shapes=len(shapes), seconds=round(total, 3))
        return total

    def part(self, cohort: Sequence[Pending]) -> bool:
        """A part of a request over the token bound: the forward behind the cohorts'. A
        one-lane part longer than `part_chunk` runs a chunk a call (`ChunkedLane`, kept on
        the part): False while chunks remain, True once its rows are recorded."""
        if self._part_chunk is None or len(cohort) != 1:
            self(cohort, background=True)
            return True
        (p,) = cohort
        if len(p.lane_ids) != 1 or len(p.lane_ids[0]) <= self._part_chunk:  # runs whole
            self(cohort, background=True)
            return True
        with self._thread_stream(background=True):
            if p.progress is None:
                ids = torch.tensor([p.lane_ids[0]], dtype=torch.long).to(self._device)
                p.progress = ChunkedLane(self._model, ids, runner=self._runner())
            lane: ChunkedLane = p.progress
            rows = lane.step()  # (1, P, d) at the last chunk
            if rows is None:
                return False
            slots = tuple(Slot(p.plan.request_id, p.plan.token, i, 0) for i in p.indices()[0])
            self._plans.record(CohortStamp(slots, self._mode), rows, [lane.length])
        return True

    @property
    def chunk_runner(self) -> ChunkRunner | None:
        """The chunked lanes' runner once the warm-up (or a first chunk) made it."""
        return self._chunks

    def _runner(self) -> ChunkRunner:
        """The chunks' runner, shared by every chunked lane: on CUDA its CUDA graphs, recorded
        here once; a recording that fails is reported and the chunks run eagerly."""
        if self._chunks is not None:
            return self._chunks
        assert self._part_chunk is not None
        args = (self._model, self._part_chunk, self._part_chunk_len)
        try:
            self._chunks = ChunkRunner(*args, pad_id=self._pad_id,
                                       graph=self._device.type == "cuda")  # fmt: skip
        except RuntimeError as e:
            log.warning("chunk graph not recorded: chunks run eagerly", error=str(e))
            self._chunks = ChunkRunner(*args, pad_id=self._pad_id)
        return self._chunks

    def __call__(self, cohort: Sequence[Pending], *, background: bool = False) -> None:
        width = max(p.bucket for p in cohort)
        slots: list[Slot] = []
        lanes: list[Sequence[int]] = []
        for p in cohort:
            for ids, indices in zip(p.lane_ids, p.indices(), strict=True):
                slots += [Slot(p.plan.request_id, p.plan.token, i, len(lanes)) for i in indices]
                lanes.append(ids)
        real = len(lanes)
        padded = real if self._lane_buckets is None else lane_bucket(real, self._lane_buckets)
        batch = max(padded, self._min_lanes)
        # (B, P); rows past `real` are dummy lanes of pad ids, cut off before the plan table
        ids = torch.full((batch, width), self._pad_id, dtype=torch.long)
        for row, lane in enumerate(lanes):
            ids[row, : len(lane)] = torch.tensor(lane, dtype=torch.long)
        # The valid prefix of each batch row, as the ids were actually laid out: the plan table
        # checks it against each plan's lane lengths. No mask goes to the model (see the
        # module docstring): causality alone keeps pad columns out of the valid rows.
        lengths = [len(lane) for lane in lanes]
        stamp = CohortStamp(tuple(slots), self._mode)
        with self._thread_stream(background):
            capture(
                self._model,
                ids.to(self._device),
                on_rows=lambda rows: self._plans.record(stamp, rows[:real], lengths),
            )
        if self._graphs is not None:
            self._compiled_since(batch, width)

    def _compiled_since(self, lanes: int, width: int) -> None:
        """Report a forward of this shape that compiled a graph after the warm-up."""
        with self._graphs_lock:
            now = graphs_compiled()
            new, self._graphs = now - self._graphs, now
        if new > 0:
            log.warning("compiled after the warm-up", lanes=lanes, width=width, graphs=new)
            self._on_compile()

    @contextmanager
    def _thread_stream(self, background: bool) -> Iterator[None]:
        """This thread's own CUDA stream around a forward, of the lowest priority for a
        background forward (or its green context's, with `part_sms`) and of the highest
        otherwise (without `thread_streams`, or off CUDA, the current stream). The forward's
        rows are consumed on other threads' streams, so the forward is synchronised before it
        returns: whatever reads its rows next finds them written, and nothing still in flight
        reads a freed block's memory when the allocator hands it to this stream again."""
        if self._streams is None:
            yield
            return
        name = "background" if background else "foreground"
        stream = getattr(self._streams, name, None)
        if stream is None:
            stream = self._part_stream(background) or torch.cuda.Stream(
                self._device, priority=stream_priority(background)
            )
            setattr(self._streams, name, stream)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            stream.synchronize()

    def _part_stream(self, background: bool) -> torch.cuda.Stream | None:
        """A part's stream in a green context of `part_sms` SMs, or None (no `part_sms`, or
        not a part). Work on a green context's stream runs on its SMs whatever context is
        current, so the context is never pushed: pushed around a compiled forward, torch
        2.11's pop found another context current and asserted (docs/BENCHMARKS.md)."""
        if not background or self._part_sms is None:
            return None
        if self._green is None:  # parts run on one thread: no race to make it
            from torch.cuda.green_contexts import GreenContext

            index = self._device.index if self._device.index is not None else 0
            green = GreenContext.create(num_sms=self._part_sms, device_id=index)
            # one stream for every part: Stream() makes a new one at each call
            self._green = (green, green.Stream())
        return self._green[1]


def stream_priority(background: bool) -> int:
    """A CUDA stream priority: background work at 0, the default and lowest, the rest at
    -1, torch's high-priority streams (lower numbers run first where both have work)."""
    return 0 if background else -1
