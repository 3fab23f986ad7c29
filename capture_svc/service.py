"""Capture logic: validate, tokenise, plan, one batched forward, consume, sign, publish.

No transport here: the gRPC servicer hands over the request's `CaptureLane` messages (the
lane's input, depth and the one sampling type, stateblock.protocol.sampling) and maps the
`CaptureError` tree to status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from capture_svc.batcher import Dropped, ForwardBatcher
from capture_svc.config import CaptureConfig
from capture_svc.dataplane import DataPlane
from capture_svc.plans import CapturePlan, PlanError, PlanTable, first_lanes
from capture_svc.publisher import PublishError
from stateblock import runtime
from stateblock.model.loading import ServingModel
from stateblock.model.prompts import PromptEncoder
from stateblock.model.rows import check_rows
from stateblock.model.slots import SlotPoolFull
from stateblock.protocol import layouts, sampling
from stateblock.protocol.ids import uuid7
from stateblock.protocol.sampling import InvalidSampling
from stateblock.v1 import block_pb2 as pb
from stateblock.v1 import capture_pb2

log = structlog.get_logger("capture_svc")
CAPTURE_MODE = pb.CAPTURE_MODE_FINAL_HIDDEN
# A request whose lanes hold this many characters or ids in all is tokenized on a thread (the
# tokenizers library lets go of the GIL): a maximal one, 8 prompts of 4,096 tokens, takes
# 10-25 ms, which on the event loop would hold up every small request beside it; a short one
# costs less than the thread hop.
OFF_LOOP_INPUT = 8192


def lane_text(lane: capture_pb2.CaptureLane) -> str:
    """A text or chat lane's text: the prompt, or its messages' contents."""
    if lane.WhichOneof("input") == "chat":
        return "".join(m.content for m in lane.chat.messages)
    return lane.prompt


def input_size(lane: capture_pb2.CaptureLane) -> int:
    """A lane's input in characters (its text or chat) or ids (given as token ids)."""
    if lane.WhichOneof("input") == "tokens":
        return len(lane.tokens.ids)
    return len(lane_text(lane))


def input_key(lane: capture_pb2.CaptureLane) -> tuple[str | None, object]:
    """What a lane's ids depend on: lanes of one key tokenize to the same ids (`n` > 1 of one
    prompt is one tokenization)."""
    which = lane.WhichOneof("input")
    if which == "prompt":
        return which, lane.prompt
    if which is None:
        return None, None
    return which, getattr(lane, which).SerializeToString(deterministic=True)


class CaptureError(Exception):
    """Base of the capture service's failures."""


class InvalidCapture(CaptureError):
    """The request cannot be captured as asked (INVALID_ARGUMENT); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class CaptureUnavailable(CaptureError):
    """Publishing failed or the service is stopping (UNAVAILABLE)."""


class CaptureWarmingUp(CaptureUnavailable):
    """The forward is still warming up (UNAVAILABLE): nothing ran, so it may be sent again."""


class CaptureDropped(CaptureError):
    """Its caller cancelled it before its forward (CANCELLED): nothing ran or was published."""


class CaptureFailed(CaptureError):
    """The capture broke an integrity check (INTERNAL); the request gets no block."""


@dataclass(frozen=True)
class Captured:
    request_id: str
    block_id: str
    prompt_tokens: tuple[int, ...]
    via_object_store: bool


class AllocatorEvents:
    """`stateblock_capture_cuda_allocator_total{event}`, read from torch's CUDA caching
    allocator at each scrape: `retry` (an allocation that freed the cache and tried again),
    `device_sync` (a synchronisation of every stream: what a retry or a cudaFree costs, and
    a forward beside another then waits for the other's kernels), `cuda_malloc`, `cuda_free`
    and `oom`. Nothing where CUDA was never initialised (the CPU)."""

    STATS = {"retry": "num_alloc_retries", "device_sync": "num_sync_all_streams",
             "cuda_malloc": "num_device_alloc", "cuda_free": "num_device_free",
             "oom": "num_ooms"}  # fmt: skip

    def collect(self):
        import torch
        from prometheus_client.core import CounterMetricFamily

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        family = CounterMetricFamily(
            "stateblock_capture_cuda_allocator",
            "CUDA caching allocator events of this process (see AllocatorEvents).",
            labels=["event"],
        )
        stats = torch.cuda.memory_stats()
        for event, key in self.STATS.items():
            family.add_metric([event], float(stats.get(key, 0)))
        yield family


class RouteStages:
    """The stage histogram's children for one route: `labels(stage)` as a histogram labelled
    by stage alone gives them (what the data plane's `deliver` observes through)."""

    def __init__(self, histogram: Histogram, route: str) -> None:
        self._histogram, self._route = histogram, route

    def labels(self, stage: str) -> Histogram:
        return self._histogram.labels(stage, self._route)


class CaptureMetrics:
    def __init__(self, metrics: CollectorRegistry) -> None:
        metrics.register(AllocatorEvents())
        self.capture_seconds = Histogram(
            "stateblock_capture_seconds",
            "Capture request latency: tokenise, forward, sign, publish.",
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=metrics,
        )
        # where a capture's time goes: the wire-size block makes sign and publish matter
        self.stage_seconds = runtime.stage_histogram(
            "stateblock_capture_stage_seconds",
            "Capture time by stage: tokenize, forward (queue + base forward + rows to host, "
            "but for a local data plane's; of it forward_wait, until its first forward began "
            "on a thread, and forward_run, its forwards' time there), reserve (a place for "
            "the rows: a slot or region, "
            "waited for while every one is held; none on the bus), sign (digest + signature; "
            "of it, on the host plane, rows_copy, rows_digest and rows_write, the rows "
            "leaving the GPU in pieces, hashed and written), publish (JetStream ack). "
            "Label `route`: `cohort` for a request that went in a cohort's forward, `parts` "
            "for one captured in parts (over the token bound, or a lane long enough for "
            "chunks), so the small requests' time reads apart from the maximal ones'.",
            metrics,
            labels=("route",),
        )
        self.cohort_lanes = Histogram(
            "stateblock_capture_cohort_lanes",
            "Lanes per packed base forward.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
            registry=metrics,
        )
        self.slots_held = Gauge(
            "stateblock_capture_slots_held",
            "Local and host data planes: slots (shared-memory regions) holding a block's rows "
            "until its commit, rejection or expiry (0 on the bus).",
            registry=metrics,
        )
        self.warmup_seconds = Gauge(
            "stateblock_capture_warmup_seconds",
            "Start-up warm-up: every compiled (lanes, width) shape run before SERVING.",
            registry=metrics,
        )
        self.compiled_after_warmup = Counter(
            "stateblock_capture_compiled_after_warmup_total",
            "Compiled only: forwards after the warm-up that compiled a graph (a stall of "
            "seconds on a request's path: the warm-up missed a shape); 0 is the design. The "
            "count is the process's, so in one process with a readout that compiles, its "
            "graphs count too.",
            registry=metrics,
        )
        self.warmup_cache = Gauge(
            "stateblock_capture_warmup_cache_lookups",
            "Compiled only: the warm-up's compiled-graph cache lookups (inductor's FX graphs, "
            "AOTAutograd's), hits and misses; hits are graphs not compiled again.",
            ["cache", "outcome"],
            registry=metrics,
        )


class CaptureService:
    def __init__(
        self,
        model: ServingModel,
        plans: PlanTable,
        batcher: ForwardBatcher,
        plane: DataPlane,
        metrics: CaptureMetrics,
        *,
        config: CaptureConfig,
    ) -> None:
        self._model, self._plans, self._config = model, plans, config
        self._batcher, self._plane, self._metrics = batcher, plane, metrics
        self._encode = PromptEncoder(model.tokenizer)
        self._ready = False

    def mark_ready(self) -> None:
        """The forward is warmed up: requests are taken from here on."""
        self._ready = True

    def tokenize(self, lane: capture_pb2.CaptureLane, index: int) -> list[int]:
        tok = self._model.tokenizer
        if lane.WhichOneof("input") == "tokens":  # read as given, as vLLM reads prompt ids
            return self._check_ids(list(lane.tokens.ids), index)
        is_chat = lane.WhichOneof("input") == "chat"
        text = lane_text(lane)
        try:  # before tokenising: an oversized text costs nothing
            sampling.check_prompt_text(
                text, self._config.limits, "messages" if is_chat else "prompt"
            )
        except InvalidSampling as e:
            raise InvalidCapture(f"lane {index}: {e}", e.param) from e
        if is_chat:
            messages = lane.chat.messages
            if not any(m.content for m in messages):
                raise InvalidCapture(f"lane {index}: the chat has no content", "messages")
            chat = [{"role": m.role, "content": m.content} for m in messages]
            out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        else:
            if not lane.prompt:
                raise InvalidCapture(f"lane {index}: the prompt is empty", "prompt")
            ids = self._encode(lane.prompt)
        ids = list(ids)
        limit = self._config.limits.prompt_len_max
        if len(ids) > limit:
            param = "messages" if is_chat else "prompt"
            raise InvalidCapture(
                f"lane {index}: the prompt is {len(ids)} tokens, over the prompt_len maximum "
                f"of {limit}",
                param,
            )
        return ids

    async def _tokenize_lanes(self, lanes: Sequence[capture_pb2.CaptureLane]) -> list[list[int]]:
        """Every lane's ids, each distinct input tokenized once (its first lane's errors), on
        a thread where the request's input is long (OFF_LOOP_INPUT)."""

        keys = [input_key(lane) for lane in lanes]
        first: dict[tuple[str | None, object], int] = {}  # each input's first lane, in order
        for i, key in enumerate(keys):
            first.setdefault(key, i)

        def run() -> list[list[int]]:
            ids = {key: self.tokenize(lanes[i], i) for key, i in first.items()}
            return [list(ids[key]) for key in keys]

        if sum(input_size(lanes[i]) for i in first.values()) < OFF_LOOP_INPUT:
            return run()
        return await asyncio.to_thread(run)

    def _plan(
        self, request_id: str, lanes: Sequence[capture_pb2.CaptureLane], lane_ids: list[list[int]]
    ) -> tuple[pb.Layout, CapturePlan]:
        """The request's layout, and its plan registered in the capture registry."""
        layout = layouts.make_layout(
            request_id,
            [len(ids) for ids in lane_ids],
            [lane.max_tokens for lane in lanes],
            hidden_size=self._model.hidden_size,
            dtype=self._model.dtype,
            capture_mode=CAPTURE_MODE,
            prompt_ids=lane_ids if self._model.reads_prompt_ids else None,
            row_owners=first_lanes(lane_ids),
        )
        try:
            return layout, self._plans.register(request_id, layout, lane_ids)
        except PlanError as e:
            raise InvalidCapture(str(e), "request_id") from e

    def _check_ids(self, ids: list[int], index: int) -> list[int]:
        vocab = int(self._model.lm_head.shape[0])
        if not ids:
            raise InvalidCapture(f"lane {index}: the prompt has no token ids", "prompt")
        if len(ids) > self._config.limits.prompt_len_max:
            raise InvalidCapture(
                f"lane {index}: the prompt is {len(ids)} tokens, over the prompt_len maximum "
                f"of {self._config.limits.prompt_len_max}",
                "prompt",
            )
        if max(ids) >= vocab:
            raise InvalidCapture(
                f"lane {index}: token id {max(ids)} is outside the vocabulary of {vocab}", "prompt"
            )
        return ids

    def _check(self, model: str, lanes: Sequence[capture_pb2.CaptureLane]) -> None:
        """The gateway checked the same with the same limits; a capture called directly
        (or by a gateway configured otherwise) is held to them too."""
        limits = self._config.limits
        if model != self._model.name:
            raise InvalidCapture(f"model {model!r} is not served here", "model")
        try:
            sampling.check_lane_count(len(lanes), limits)
            for i, lane in enumerate(lanes):
                if lane.WhichOneof("input") is None:
                    raise InvalidCapture(f"lane {i}: exactly one of prompt and chat", "prompt")
                sampling.check_lane(lane.sampling, lane.max_tokens, limits)
        except InvalidSampling as e:
            raise InvalidCapture(str(e), e.param) from e

    def cancel(self, request_id: str) -> bool:
        """Drop the request if its forward has not started (its capture then raises
        CaptureDropped); False when it has (its capture goes on to publish) or is unknown."""
        dropped = self._batcher.drop(request_id)
        log.info("capture cancel", request_id=request_id, dropped=dropped)
        return dropped

    async def capture(
        self,
        request_id: str | None,
        model: str,
        lanes: Sequence[capture_pb2.CaptureLane],
    ) -> Captured:
        if not self._ready:  # a shape not warmed up yet would compile on this request
            raise CaptureWarmingUp("the capture is warming up its forward; send it again")
        t0 = time.perf_counter()
        request_id = request_id or uuid7()
        self._check(model, lanes)
        lane_ids = await self._tokenize_lanes(lanes)
        layout, plan = self._plan(request_id, lanes, lane_ids)
        stage = RouteStages(
            self._metrics.stage_seconds, "parts" if self._batcher.over_bound(lane_ids) else "cohort"
        )
        t1 = time.perf_counter()
        stage.labels("tokenize").observe(t1 - t0)
        try:
            timing = await self._batcher.submit(plan, lane_ids)
            rows = self._plans.consume(request_id, plan.layout_digest)
        except Dropped as e:
            raise CaptureDropped(str(e)) from e
        except PlanError as e:
            log.error("capture integrity check failed", error=str(e))
            raise CaptureFailed(str(e)) from e
        finally:
            self._plans.discard(request_id)  # no-op once consumed
        t2 = time.perf_counter()
        stage.labels("forward").observe(t2 - t1)
        stage.labels("forward_wait").observe(timing.waited)
        stage.labels("forward_run").observe(timing.ran)
        check_rows(rows, layout)
        try:
            delivered = await self._plane.deliver(
                layout, rows, request_id=request_id, sampling=[lane.sampling for lane in lanes],
                stage=stage,
            )  # fmt: skip
        except (PublishError, SlotPoolFull) as e:
            raise CaptureUnavailable(str(e)) from e
        t4 = time.perf_counter()
        self._metrics.capture_seconds.observe(t4 - t0)
        log.info(
            "block published",
            block_id=delivered.block_id,
            lanes=len(lanes),
            rows=layout.total_rows,
            via_object_store=delivered.via_object_store,
        )
        return Captured(
            request_id,
            delivered.block_id,
            tuple(len(ids) for ids in lane_ids),
            delivered.via_object_store,
        )
