"""The capture plan table: in-process, request-scoped (docs/ARCHITECTURE.md, "Capture").

A request registers an immutable plan (its layout) before the forward. The forward hook
records the cohort's rows through `record`, stamped with each slot's request identity;
the table checks identity, per-lane lengths (of the token rows the cohort's forward was
built from), total rows, the layout digest and the capture mode, and holds the rows for
that request only. A request over the cohort's token budget is captured in parts, some of
its lanes a forward (capture_svc.batcher): each lane is recorded exactly once, by whichever
forward carried it, and the request's rows are assembled, in lane order, and checked once
its last lane is in. Lanes of one request with the same ids (`n` > 1 of one prompt), where
its plan was given the lanes' ids, share a batch row, each lane stamped on it; a row stamped
by two requests, or by two prompts of one, poisons them. `consume`
hands the rows over exactly once, against the layout digest.

`record` runs on the forward thread inside the hook, the rest on the event loop, so every
method takes the lock. A failed check poisons only the request it concerns: the other
requests of the cohort keep their rows. The copy of a GPU's rows to the host runs after
`record` lets go of the lock: it waits for the forward's kernels, and the event loop's
`register` and `consume` must not wait with it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge
from torch import Tensor

from stateblock.protocol import layouts
from stateblock.v1 import block_pb2 as pb

_REMEMBERED_CONSUMED = 4096  # request ids kept to tell a double consume from an unknown id


def distinct(
    lane_ids: Sequence[Sequence[int]],
) -> tuple[list[Sequence[int]], list[tuple[int, ...]]]:
    """A request's distinct lanes, in first-seen order, and the lane indices each one fills:
    `n` > 1 of one prompt is one prompt to run forward (its rows are the same whatever the
    lane: a forward's rows do not depend on the company a lane keeps)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(lane_ids):
        groups.setdefault(tuple(ids), []).append(i)
    return [list(ids) for ids in groups], [tuple(g) for g in groups.values()]


def first_lanes(lane_ids: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Each lane's first lane of the same prompt (its own index where it is the first)."""
    first = {i: group[0] for group in distinct(lane_ids)[1] for i in group}
    return tuple(first[i] for i in range(len(lane_ids)))


def to_host(rows: Tensor) -> Tensor:
    """A request's rows in host memory (the forward's device synchronised for a GPU's)."""
    return rows if rows.device.type == "cpu" else rows.to("cpu")


class PlanError(Exception):
    """Base of every plan-table failure."""


class CaptureIntegrityError(PlanError):
    """A recorded capture does not match its plan; `kind` names the failed check."""

    def __init__(self, kind: str, request_id: str, detail: str) -> None:
        self.kind = kind
        self.request_id = request_id
        super().__init__(f"capture {kind} for request {request_id}: {detail}")


class DuplicatePlan(PlanError):
    pass


class PlanNotFound(PlanError):
    pass


class NotRecorded(PlanError):
    """The forward finished without recording rows for the request."""


class DoubleConsume(PlanError):
    pass


class PlanTableMetrics:
    """The plan table's 13 series, names fixed (Counter adds `_total`): dashboards read them."""

    def __init__(self, metrics: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"stateblock_capture_{name}", doc, registry=metrics)

        self.plans_registered = counter("plans_registered", "Capture plans registered.")
        self.records = counter("records", "Requests recorded by the forward hook.")
        self.consumed = counter("consumed", "Captures handed to their request.")
        self.cross_request_events = counter(
            "cross_request_events", "Rows that would have reached another request's slot."
        )
        self.identity_mismatch = counter("identity_mismatch", "Hook stamp != plan identity.")
        self.lane_length_mismatch = counter("lane_length_mismatch", "Lane length != plan.")
        self.row_count_mismatch = counter("row_count_mismatch", "Total rows != plan.")
        self.layout_digest_mismatch = counter("layout_digest_mismatch", "Layout digest != plan.")
        self.mode_mismatch = counter("mode_mismatch", "Capture mode != plan.")
        self.double_consume = counter("double_consume", "Second consume of one capture.")
        self.unplanned_records = counter("unplanned_records", "Records with no plan.")
        self.expired_plans = counter("expired_plans", "Plans that expired unconsumed.")
        self.active_plans = Gauge(
            "stateblock_capture_active_plans",
            "Plans registered, not yet consumed.",
            registry=metrics,
        )


@dataclass(frozen=True)
class Slot:
    """One batch row of a cohort forward, stamped with the request it belongs to."""

    request_id: str
    plan_token: str  # the plan's nonce: a stale stamp for a re-used request id fails
    lane_index: int
    batch_row: int


@dataclass(frozen=True)
class CohortStamp:
    slots: tuple[Slot, ...]
    capture_mode: int


@dataclass(frozen=True)
class CapturePlan:
    """Immutable: the layout is kept as its deterministic bytes, not a mutable message."""

    request_id: str
    token: str
    layout_bytes: bytes
    layout_digest: bytes
    lane_lengths: tuple[int, ...]
    answer_depths: tuple[int, ...]
    total_rows: int
    hidden_size: int
    dtype: int
    capture_mode: int
    expires_at: float
    # each lane's prompt ids where the layout carries them (a decoder that reads them)
    prompt_ids: tuple[tuple[int, ...], ...] | None = None
    # each lane's first lane of the same prompt, where the caller gave the prompts or the
    # layout shares rows: lanes of one prompt may share a batch row; else a row each
    prompt_of: tuple[int, ...] | None = None
    # each lane's lane whose rows it reads (layouts.row_owners): only lanes that read their
    # own are packed
    row_owners: tuple[int, ...] = ()

    @property
    def layout(self) -> pb.Layout:
        layout = pb.Layout()
        layout.ParseFromString(self.layout_bytes)
        return layout


@dataclass
class _Entry:
    plan: CapturePlan
    rows: Tensor | None = None
    error: CaptureIntegrityError | None = None
    lanes: dict[int, Tensor] = field(default_factory=dict)  # recorded so far, by lane index


class PlanTable:
    def __init__(
        self,
        metrics: PlanTableMetrics,
        *,
        plan_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        host_rows: bool = True,
    ) -> None:
        """`host_rows`: each request's rows are copied to the host (the bus carries bytes);
        False leaves them on the forward's device (the local data plane's slots)."""
        self._m = metrics
        self._host_rows = host_rows
        self._ttl = plan_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._consumed: OrderedDict[str, None] = OrderedDict()

    # -- event-loop side ---------------------------------------------------------------
    def register(
        self,
        request_id: str,
        layout: pb.Layout,
        lane_prompts: Sequence[Sequence[int]] | None = None,
    ) -> CapturePlan:
        """The request's plan. `lane_prompts` (each lane's ids) lets lanes of one prompt be
        recorded from one batch row (`n` > 1 goes forward once)."""
        layouts.check_layout(layout, request_id)
        owners, holders = layouts.row_owners(layout), layouts.lane_rows(layout)
        prompt_of = None if owners == tuple(range(len(owners))) else owners
        if lane_prompts is not None:
            if len(lane_prompts) != len(layout.lanes):
                raise ValueError(f"{len(lane_prompts)} prompts for {len(layout.lanes)} lanes")
            prompt_of = first_lanes(lane_prompts)
            if any(prompt_of[i] != prompt_of[o] for i, o in enumerate(owners)):
                raise ValueError(f"lanes of one row owner {owners} differ in prompt {prompt_of}")
        plan = CapturePlan(
            request_id=request_id,
            token=secrets.token_hex(8),
            layout_bytes=layout.SerializeToString(deterministic=True),
            layout_digest=layouts.layout_digest(layout),
            lane_lengths=tuple(held.row_count for held in holders),
            answer_depths=tuple(lane.answer_depth for lane in layout.lanes),
            total_rows=layout.total_rows,
            hidden_size=layout.hidden_size,
            dtype=layout.dtype,
            capture_mode=layout.capture_mode,
            expires_at=self._clock() + self._ttl,
            prompt_ids=tuple(tuple(held.prompt_token_ids) for held in holders)
            if layout.lanes[0].prompt_token_ids
            else None,
            prompt_of=prompt_of,
            row_owners=owners,
        )
        with self._lock:
            self._sweep_locked()
            if request_id in self._entries or request_id in self._consumed:
                raise DuplicatePlan(f"request {request_id} already has a capture plan")
            self._entries[request_id] = _Entry(plan)
            self._m.plans_registered.inc()
            self._m.active_plans.set(len(self._entries))
        return plan

    def consume(self, request_id: str, layout_digest: bytes) -> Tensor:
        """The request's packed rows (total_rows, hidden_size), exactly once."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                if request_id in self._consumed:
                    self._m.double_consume.inc()
                    raise DoubleConsume(f"request {request_id} was already consumed")
                raise PlanNotFound(f"request {request_id} has no capture plan")
            if entry.error is None and entry.rows is None:
                detail = f"{len(entry.lanes)} of {len(entry.plan.lane_lengths)} lanes recorded"
                raise NotRecorded(f"request {request_id}: the forward recorded no rows ({detail})")
            del self._entries[request_id]
            self._m.active_plans.set(len(self._entries))
            self._remember_consumed(request_id)
            if entry.error is not None:
                raise entry.error
            if layout_digest != entry.plan.layout_digest:
                self._m.layout_digest_mismatch.inc()
                raise CaptureIntegrityError("layout_digest_mismatch", request_id, "at consume")
            self._m.consumed.inc()
            assert entry.rows is not None
            return entry.rows

    def discard(self, request_id: str) -> None:
        """Drop a plan whose request failed before consuming (not counted as expired)."""
        with self._lock:
            if self._entries.pop(request_id, None) is not None:
                self._m.active_plans.set(len(self._entries))

    def sweep(self) -> int:
        with self._lock:
            return self._sweep_locked()

    def active(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- forward-thread side -----------------------------------------------------------
    def record(self, stamp: CohortStamp, rows: Tensor, lane_lengths: Sequence[int]) -> None:
        """Called by the hook: rows (B, P, d) of one cohort, lane_lengths (B,) of its inputs."""
        assembled: list[_Entry] = []
        with self._lock:
            rows_of: dict[str, list[Slot]] = {}
            row_owner: dict[int, tuple[str, int]] = {}  # lanes of one prompt may share a row
            for slot in stamp.slots:
                rows_of.setdefault(slot.request_id, []).append(slot)
                claim = self._row_claim(slot)
                owner = row_owner.setdefault(slot.batch_row, claim)
                if owner != claim or not 0 <= slot.batch_row < rows.shape[0]:
                    # Two requests (or two prompts) stamped on one batch row, or a row the
                    # forward lacks: whatever was there would reach the wrong lane.
                    self._m.cross_request_events.inc()
                    for rid in {s.request_id for s in stamp.slots}:
                        self._fail(rid, "cross_request_events", f"batch row {slot.batch_row}")
                    return
            for request_id, slots in rows_of.items():
                entry = self._record_one(request_id, slots, stamp.capture_mode, rows, lane_lengths)
                if entry is not None:
                    assembled.append(entry)
        if self._host_rows:
            self._to_host(assembled)

    def _row_claim(self, slot: Slot) -> tuple[str, int]:
        """Whose a batch row's rows are: the request, and the prompt (its first lane) where
        its plan lets lanes of one prompt share a row, else the lane itself."""
        entry = self._entries.get(slot.request_id)
        shared = None if entry is None else entry.plan.prompt_of
        lane = slot.lane_index
        return slot.request_id, shared[lane] if shared and 0 <= lane < len(shared) else lane

    def _to_host(self, assembled: list[_Entry]) -> None:
        """Each assembled request's rows to the host, outside the lock. Its consume waits
        for the forward that called `record` to return, so nothing reads them meanwhile; a
        request failed or discarded in between keeps what that left."""
        for entry in assembled:
            rows = entry.rows
            if rows is None:
                continue
            host = to_host(rows)
            with self._lock:
                if entry.rows is rows:
                    entry.rows = host

    def _record_one(
        self,
        request_id: str,
        slots: list[Slot],
        mode: int,
        rows: Tensor,
        lane_lengths: Sequence[int],
    ) -> _Entry | None:
        """Record a request's lanes of this cohort; its entry once its rows are assembled."""
        entry = self._entries.get(request_id)
        if entry is None:
            self._m.unplanned_records.inc()
            return None
        self._m.records.inc()
        plan = entry.plan
        if entry.error is not None:  # poisoned already: nothing more of it is kept
            return None
        if any(s.lane_index in entry.lanes for s in slots) or entry.rows is not None:
            self._m.cross_request_events.inc()
            self._fail(request_id, "cross_request_events", "a second forward recorded a lane")
            return None
        if any(s.plan_token != plan.token for s in slots):
            self._m.identity_mismatch.inc()
            self._fail(request_id, "identity_mismatch", "hook stamp is not this plan's")
            return None
        if mode != plan.capture_mode:
            self._m.mode_mismatch.inc()
            self._fail(
                request_id, "mode_mismatch", f"captured mode {mode}, plan {plan.capture_mode}"
            )
            return None
        slots = sorted(slots, key=lambda s: s.lane_index)
        indices = [s.lane_index for s in slots]
        actual = [int(lane_lengths[s.batch_row]) for s in slots]
        planned = [plan.lane_lengths[i] for i in indices if 0 <= i < len(plan.lane_lengths)]
        if len(set(indices)) != len(indices) or actual != planned:
            self._m.lane_length_mismatch.inc()
            detail = f"lanes {indices} of {actual} rows, plan {list(plan.lane_lengths)}"
            self._fail(request_id, "lane_length_mismatch", detail)
            return None
        views = [rows[s.batch_row, :n] for s, n in zip(slots, actual, strict=True)]
        if len(indices) == len(plan.lane_lengths):  # the whole request in one forward
            return entry if self._assemble(request_id, entry, mode, views) else None
        # a part is copied at record time, where it is: a compiled forward's next replay
        # overwrites it; lanes of one prompt share its batch row, so one copy a row
        copies: dict[int, Tensor] = {}
        for s, view in zip(slots, views, strict=True):
            if s.batch_row not in copies:
                copies[s.batch_row] = view.detach().clone()
            entry.lanes[s.lane_index] = copies[s.batch_row]
        if len(entry.lanes) < len(plan.lane_lengths):
            return None
        parts = [entry.lanes.pop(i) for i in range(len(plan.lane_lengths))]
        return entry if self._assemble(request_id, entry, mode, parts) else None

    def _assemble(self, request_id: str, entry: _Entry, mode: int, lanes: list[Tensor]) -> bool:
        """Every lane is in (in lane order): the request's packed rows, checked against its
        plan, on the forward's device (`record` copies them to the host after the lock);
        False when a check failed."""
        plan = entry.plan
        owned = [rows for i, rows in enumerate(lanes) if plan.row_owners[i] == i]
        # cat copies: the request owns its rows, whatever becomes of the cohort tensor
        packed = torch.cat(owned).detach()  # (total_rows, d)
        actual = list(plan.lane_lengths)
        if packed.shape[0] != plan.total_rows:
            self._m.row_count_mismatch.inc()
            detail = f"{packed.shape[0]} rows, plan {plan.total_rows}"
            self._fail(request_id, "row_count_mismatch", detail)
            return False
        try:
            seen = layouts.make_layout(
                request_id,
                actual,
                plan.answer_depths,
                hidden_size=packed.shape[1],
                dtype=packed.dtype,
                capture_mode=mode,
                prompt_ids=plan.prompt_ids,
                row_owners=plan.row_owners,
            )
            digest_ok = layouts.layout_digest(seen) == plan.layout_digest
        except layouts.LayoutError:
            digest_ok = False
        if not digest_ok:
            self._m.layout_digest_mismatch.inc()
            self._fail(request_id, "layout_digest_mismatch", "recorded layout != plan")
            return False
        entry.rows = packed
        return True

    def _fail(self, request_id: str, kind: str, detail: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry.error is None:
            entry.error = CaptureIntegrityError(kind, request_id, detail)
            entry.rows = None
            entry.lanes = {}

    def _sweep_locked(self) -> int:
        now = self._clock()
        expired = [rid for rid, e in self._entries.items() if e.plan.expires_at <= now]
        for rid in expired:
            del self._entries[rid]
            self._m.expired_plans.inc()
        if expired:
            self._m.active_plans.set(len(self._entries))
        return len(expired)

    def _remember_consumed(self, request_id: str) -> None:
        self._consumed[request_id] = None
        while len(self._consumed) > _REMEMBERED_CONSUMED:
            self._consumed.popitem(last=False)
