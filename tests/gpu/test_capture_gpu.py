"""The capture's rows on a CUDA GPU do not depend on their company: the eager capture's two
forward threads, each on a stream of its own (a cohort's rows, captured while the other
thread runs forwards of other prompts, are bit for bit the rows of the same prompts alone),
and the compiled forward at every lane bucket. Skipped cleanly without a GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_svc.batcher import Pending
from capture_svc.forward import CohortForward
from capture_svc.plans import PlanTable, PlanTableMetrics
from stateblock.protocol import layouts
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
        layout = layouts.make_layout(
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


def test_a_part_runs_on_a_low_priority_stream_and_a_cohort_on_a_high_one():
    """A part of a request over the token bound (`CohortForward.part`) launches its kernels
    on a stream of the lowest priority, a cohort on one of the highest, so a small request's
    forward is not queued behind a maximal one's; the rows are the same either way."""
    from stateblock.model.capture import backbone
    from stateblock.model.loading import load_base

    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=60)
    forward = CohortForward(
        model, plans, pad_id=tok.pad_token_id or 0, capture_mode=MODE, thread_streams=True
    )
    seen: list[int] = []
    backbone(model).register_forward_hook(
        lambda *_: seen.append(torch.cuda.current_stream().priority)
    )
    ids = [tok(PROMPTS[0])["input_ids"]]
    rows = []
    for rid, run in (("cohort", forward), ("part", forward.part)):
        layout = layouts.make_layout(rid, [len(ids[0])], [4], hidden_size=model.config.hidden_size,
                                      dtype=torch.bfloat16)  # fmt: skip
        plan = plans.register(rid, layout)
        run([Pending(plan, ids, None)])
        rows.append(plans.consume(rid, plan.layout_digest))
    assert seen[0] < seen[1] == 0  # CUDA counts down: the cohort's is the higher priority
    assert torch.equal(rows[0], rows[1])


def test_a_part_in_a_green_context_runs_on_its_stream_and_keeps_the_rows():
    """`part_sms` (`STATEBLOCK_CAPTURE_PART_SMS`): a part's kernels go on the stream of a
    green context of that many SMs, a cohort's on its own stream, and the rows are the
    same bit for bit either way (so a lane's rows do not depend on which ran it)."""
    from torch.cuda import green_contexts

    from stateblock.model.capture import backbone
    from stateblock.model.loading import load_base

    if not green_contexts.SUPPORTED:
        pytest.skip("this torch has no CUDA green contexts")
    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=60)
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 2
    forward = CohortForward(
        model, plans, pad_id=tok.pad_token_id or 0, capture_mode=MODE, thread_streams=True,
        part_sms=sms,
    )  # fmt: skip
    seen: list[int] = []
    backbone(model).register_forward_hook(
        lambda *_: seen.append(torch.cuda.current_stream().cuda_stream)
    )
    ids = [tok(PROMPTS[0])["input_ids"]]
    rows = []
    for rid, run in (("cohort", forward), ("part", forward.part), ("part2", forward.part)):
        layout = layouts.make_layout(rid, [len(ids[0])], [4], hidden_size=model.config.hidden_size,
                                      dtype=torch.bfloat16)  # fmt: skip
        plan = plans.register(rid, layout)
        run([Pending(plan, ids, None)])
        rows.append(plans.consume(rid, plan.layout_digest))
    green = forward._green[1].cuda_stream
    assert seen[1] == seen[2] == green != seen[0]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_forward_gives_each_prompt_its_rows_alone_in_any_cohort(mode):
    """Compiled, as the service runs it (padded to lane buckets under CUDA graphs, at its own
    lane count otherwise; no cohort of one lane), a prompt's rows in a cohort of 2 to 16
    lanes (the others other prompts) equal its rows alone bit for bit: a request's answer
    does not depend on its company."""
    from capture_svc.batcher import bucket_width, warm_shapes
    from capture_svc.config import CaptureConfig
    from stateblock.model.capture import compile_backbone, uncompile_backbone
    from stateblock.model.loading import load_base

    config = CaptureConfig.from_env({"STATEBLOCK_CAPTURE_COMPILE": mode})
    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=60)
    forward = CohortForward(
        model, plans, pad_id=tok.pad_token_id or 0, capture_mode=MODE,
        lane_buckets=config.cohort_lane_buckets, min_lanes=config.cohort_min_lanes,
    )  # fmt: skip
    hidden = model.config.hidden_size
    compile_backbone(model, mode)
    try:
        forward.warm_up(warm_shapes(config.warm_lane_buckets, 64))

        def run(tag: str, prompts: list[str]) -> list[torch.Tensor]:
            pending = []
            for i, p in enumerate(prompts):
                ids = [tok(p)["input_ids"]]
                layout = layouts.make_layout(
                    f"{tag}{i}", [len(ids[0])], [4], hidden_size=hidden, dtype=torch.bfloat16
                )
                pending.append(Pending(plans.register(f"{tag}{i}", layout), ids, None))
            forward(pending)
            return [plans.consume(p.plan.request_id, p.plan.layout_digest).cpu() for p in pending]

        # one width bucket (16), as the batcher's cohorts are; lengths 9 to 15
        prompts = [f"copy: {'abcdefghij'[i % 10] * (3 + i % 7)} {i}" for i in range(16)]
        assert {bucket_width(len(tok(p)["input_ids"])) for p in prompts} == {16}
        alone = [run(f"alone{i}-", [p])[0] for i, p in enumerate(prompts)]
        for lanes in (2, 3, 5, 8, 13, 16):
            got = run(f"c{lanes}-", prompts[:lanes])
            for i in range(lanes):
                assert torch.equal(got[i], alone[i]), f"{lanes} lanes, prompt {i}"
    finally:
        uncompile_backbone(model)


def test_a_chunked_part_on_a_compiled_backbone_keeps_the_rows():
    """`part_chunk` (`STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS`) on the GPU, the backbone compiled
    as served: a long lane's chunks (the eager forward recorded as a CUDA graph at the
    warm-up, replayed on the part's low-priority stream)
    give the compiled one forward's rows up to bf16 rounding, a call a chunk, and the same
    lane in chunks twice gives the same rows bit for bit."""
    from stateblock.model.capture import compile_backbone, uncompile_backbone
    from stateblock.model.loading import load_base

    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    plans = PlanTable(PlanTableMetrics(CollectorRegistry()), plan_ttl_s=60)
    forward = CohortForward(
        model, plans, pad_id=tok.pad_token_id or 0, capture_mode=MODE, thread_streams=True,
        min_lanes=2, part_chunk=8,
    )  # fmt: skip
    compile_backbone(model, "default")
    try:
        forward.warm_up(((2, 16), (2, 24), (2, 32)))
        assert forward.chunk_runner is not None and forward.chunk_runner.graphed
        ids = [tok(PROMPTS[9])["input_ids"]]
        assert 16 < len(ids[0]) <= 24  # three chunks of 8 at most
        rows, calls = [], []
        for rid, run in (("whole", forward), ("chunked", forward.part), ("again", forward.part)):
            layout = layouts.make_layout(
                rid, [len(ids[0])], [4], hidden_size=model.config.hidden_size,
                dtype=torch.bfloat16,
            )  # fmt: skip
            pending = Pending(plans.register(rid, layout), ids, None)
            n = 1
            while run([pending]) is False:
                n += 1
            calls.append(n)
            rows.append(plans.consume(rid, pending.plan.layout_digest).cpu())
        assert calls == [1, 3, 3]
        # bf16, eager chunks against compiled kernels: about 1 % apart on average (measured on
        # an H100); a chunk that attended wrongly is off by about the rows' own size
        # (tests/unit/model/test_chunked.py)
        diff = (rows[1].float() - rows[0].float()).abs()
        scale = rows[0].float().abs().mean()
        assert diff.mean() < 0.03 * scale and diff.max() < 0.5, (diff.mean(), scale, diff.max())
        assert torch.equal(rows[1], rows[2])
    finally:
        uncompile_backbone(model)


def test_a_recorded_chunk_gives_its_rows_whatever_the_company():
    """The chunk runner's CUDA graph: every lane's rows bit for bit the same run alone through
    a runner of its own and with its chunks interleaved with other lanes' through a shared
    one, and near the same forward run eagerly. Not bit for bit the eager chunk's: on an H100
    (torch 2.11) the recorded GEMMs round otherwise than the eager ones (docs/BENCHMARKS.md);
    every chunk of every lane replays a graph, so a lane's rows never mix the two."""
    from stateblock.model.capture import use_unmasked_causal_attention
    from stateblock.model.chunked import ChunkedLane, ChunkRunner
    from stateblock.model.loading import load_base
    from tests.unit.model.test_chunked import interleaved

    model, tok = load_base(REFERENCE_BASE, device="cuda", dtype=torch.bfloat16)
    use_unmasked_causal_attention(model)
    lanes = [torch.tensor([tok(p)["input_ids"]], device="cuda") for p in PROMPTS[8:12]]
    shared, eager = ChunkRunner(model, 8, 64, graph=True), ChunkRunner(model, 8, 64)
    assert shared.graphed and not eager.graphed
    together = interleaved([ChunkedLane(model, ids, runner=shared) for ids in lanes])
    alone = [
        interleaved([ChunkedLane(model, ids, runner=ChunkRunner(model, 8, 64, graph=True))])[0]
        for ids in lanes
    ]
    by_eager = interleaved([ChunkedLane(model, ids, runner=eager) for ids in lanes])
    for a, b, e in zip(together, alone, by_eager, strict=True):
        assert torch.equal(a, b)
        diff, scale = (a.float() - e.float()).abs(), e.float().abs().mean()
        assert diff.mean() < 0.03 * scale and diff.max() < 0.5, (diff.mean(), scale, diff.max())
