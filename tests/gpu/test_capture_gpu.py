"""The eager capture's two forward threads on a CUDA GPU, each on a stream of its own: a
cohort's rows, captured while the other thread runs forwards of other prompts, are bit for
bit the rows of the same prompts captured alone. Skipped cleanly without a GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.batcher import CohortForward, Pending
from capture_svc.plans import PlanTable, PlanTableMetrics
from stateblock.protocol import envelope
from stateblock.runtime import REFERENCE_BASE
from stateblock.v1 import block_pb2 as pb

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]
MODE = pb.CAPTURE_MODE_FINAL_HIDDEN
PROMPTS = [f"copy: {'abcdefghij'[i % 10] * (3 + i)} and {i}" for i in range(16)]


def test_two_forward_threads_on_their_own_streams_capture_the_rows_of_each_alone():
    from stateblock.model.loading import load_base

    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=60)
    forward = CohortForward(
        model, plans, pad_id=tok.pad_token_id or 0, capture_mode=MODE, thread_streams=True
    )
    hidden = model.config.hidden_size

    def run(rid: str, prompts: list[str]) -> torch.Tensor:
        ids = [tok(p)["input_ids"] for p in prompts]
        layout = envelope.make_layout(
            rid, [len(x) for x in ids], [4] * len(ids), hidden_size=hidden, dtype=torch.bfloat16
        )
        plan = plans.register(rid, layout)
        forward([Pending(plan, ids, None)])
        return plans.consume(rid, plan.layout_digest).cpu()

    alone = [run(f"alone{i}", [p]) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(2) as pool:  # the eager capture's two threads, 8 rounds each
        jobs = [
            pool.submit(run, f"r{round_}-{i}", [PROMPTS[i]])
            for round_ in range(8) for i in range(len(PROMPTS))
        ]  # fmt: skip
        rows = [job.result() for job in jobs]
    for k, got in enumerate(rows):
        assert torch.equal(got, alone[k % len(PROMPTS)]), f"job {k}"
