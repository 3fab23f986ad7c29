"""A request's identical lanes (`n` > 1 of one prompt) go forward as one: one batch row a
distinct prompt, each lane of it filled from that row, every lane's rows those of its
prompt alone, and a row two requests claim still poisons both."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.batcher import ForwardBatcher, Pending
from capture_svc.config import CohortLimits
from capture_svc.forward import CohortForward
from capture_svc.plans import (
    CaptureIntegrityError,
    CohortStamp,
    PlanTable,
    PlanTableMetrics,
    Slot,
    distinct,
    first_lanes,
)
from stateblock.model.rows import split_lanes
from stateblock.protocol import layouts
from tests.integration.test_fairness import MODE, forwards_of, register

D = 8


def test_distinct_lanes_and_the_lanes_each_fills():
    lanes = [[1, 2], [3], [1, 2], [1, 2], [3, 4]]
    assert distinct(lanes) == ([[1, 2], [3], [3, 4]], [(0, 2, 3), (1,), (4,)])
    assert distinct([[5]]) == ([[5]], [(0,)])


def plan_of(plans: PlanTable, rid: str, prompts, hidden: int = D, *, shared: bool = True):
    """A plan given its lanes' ids, as the capture service registers one: lanes of one
    prompt read its rows, which the block holds once (`shared`), or a copy each."""
    layout = layouts.make_layout(
        rid, [len(x) for x in prompts], [4] * len(prompts), hidden_size=hidden,
        dtype=torch.float32, row_owners=first_lanes(prompts) if shared else None,
    )  # fmt: skip
    return plans.register(rid, layout, prompts)


@pytest.mark.parametrize("shared", [True, False])
def test_lanes_of_one_prompt_share_a_row_and_nothing_else_does(shared):
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    p = plan_of(plans, "r", [[1, 2, 3], [4, 5], [1, 2, 3]], shared=shared)
    rows = torch.randn(2, 4, D)
    slots = (Slot("r", p.token, 0, 0), Slot("r", p.token, 1, 1), Slot("r", p.token, 2, 0))
    plans.record(CohortStamp(slots, MODE), rows, [3, 2])
    got = plans.consume("r", p.layout_digest)
    once = [rows[0, :3], rows[1, :2]]
    assert torch.equal(got, torch.cat(once if shared else [*once, rows[0, :3]]))
    lanes = split_lanes(got, p.layout)
    assert [lane.tolist() for lane in lanes] == [r.tolist() for r in [*once, rows[0, :3]]]
    assert p.layout.total_rows == (5 if shared else 8)

    def refused(rid: str, plan, slots) -> None:
        plans.record(CohortStamp(slots, MODE), rows, [3, 3])
        with pytest.raises(CaptureIntegrityError) as info:
            plans.consume(rid, plan.layout_digest)
        assert info.value.kind == "cross_request_events"

    # two prompts of one request of the same length on one row
    q = plan_of(plans, "q", [[1, 2, 3], [7, 8, 9]])
    refused("q", q, (Slot("q", q.token, 0, 0), Slot("q", q.token, 1, 0)))
    # one prompt twice, but a plan not told the lanes' ids: a row each
    u = register(plans, "u", (3, 3), D)
    refused("u", u, (Slot("u", u.token, 0, 0), Slot("u", u.token, 1, 0)))
    # two requests of the same prompt on one row
    a, b = plan_of(plans, "a", [[1, 2, 3]]), plan_of(plans, "b", [[1, 2, 3]])
    plans.record(CohortStamp((Slot("a", a.token, 0, 0), Slot("b", b.token, 0, 0)), MODE), rows,
                 [3, 3])  # fmt: skip
    for rid, plan in (("a", a), ("b", b)):
        with pytest.raises(CaptureIntegrityError, match="cross_request_events"):
            plans.consume(rid, plan.layout_digest)
    with pytest.raises(ValueError, match="2 prompts for 3 lanes"):
        plan_of_lanes = layouts.make_layout("z", [1, 1, 1], [4] * 3, hidden_size=D,
                                            dtype=torch.float32)  # fmt: skip
        plans.register("z", plan_of_lanes, [[1], [1]])


async def test_identical_lanes_go_forward_once():
    """8 lanes of one 9-token prompt: one lane of 16 wide, within a 32-token bound that 8
    lanes would be over; 3 distinct prompts of 4 lanes: parts of one distinct lane each."""
    parts, cohorts = await forwards_of(CohortLimits(8, 32), ("r", [[1] * 9] * 8))
    assert cohorts == [[("r", 0, 1)]] and parts == []
    lanes = [[1] * 9, [2] * 9, [1] * 9, [3] * 9]
    parts, cohorts = await forwards_of(CohortLimits(8, 16), ("r", lanes))
    assert cohorts == [] and parts == [[("r", 0, 1)], [("r", 1, 1)], [("r", 3, 1)]]


async def test_every_lane_gets_its_prompt_s_rows_alone(serving_model):
    """The real forward: a request of lanes a, a, b, a (and, in parts, a, b, a) runs 2
    forward lanes, its block holds each prompt's rows once, and each lane's rows equal its
    prompt's captured alone, bit for bit."""
    tok = serving_model.tokenizer
    hidden = serving_model.hidden_size
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=10)
    forward = CohortForward(serving_model.model, plans, pad_id=tok.pad_token_id,
                            capture_mode=MODE)  # fmt: skip
    a, b = tok("copy: same")["input_ids"], tok("sort: other")["input_ids"]
    alone = {}
    for name, ids in (("a", a), ("b", b)):
        p = register(plans, f"alone-{name}", [len(ids)], hidden)
        forward([Pending(p, [ids], None)])
        alone[name] = plans.consume(p.request_id, p.layout_digest)
    lanes_run: list[int] = []
    for limits, names in ((CohortLimits(8, 64), "aaba"), (CohortLimits(8, 16), "aba")):
        with ThreadPoolExecutor(2) as pool:
            batcher = ForwardBatcher(forward, pool, window_s=0.0, max_lanes=8, cohort=limits,
                                     forward_part=forward.part, on_cohort=lanes_run.append)  # fmt: skip
            async with batcher:
                lanes = [a if n == "a" else b for n in names]
                plan = plan_of(plans, names, lanes, hidden)
                await batcher.submit(plan, lanes)
        rows = split_lanes(plans.consume(names, plan.layout_digest), plan.layout)
        assert all(torch.equal(r, alone[n]) for r, n in zip(rows, names, strict=True)), names
        assert plan.layout.total_rows == len(a) + len(b)  # each prompt's rows once
    assert lanes_run == [2, 1, 1]  # one cohort of 2 distinct lanes; then 2 parts of 1
