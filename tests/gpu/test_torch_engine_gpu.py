"""The torch engine on a CUDA GPU: the Triton kernels, TF32, the fused attention, CUDA
graphs; each check is shared with bench/gpu_smoke.py. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from stateblock.engines.torch_engine import TorchEngine
from stateblock.model.kernels.top2 import Top2Config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu]


# -- on a GPU -----------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize(
    "cfg",
    [
        None,
        Top2Config(tma=False),
        Top2Config(persistent=True),
        Top2Config(tma=True, persistent=True),
        Top2Config(group_rows=2, n_split=3),
        Top2Config(persistent=True, group_rows=3, n_split=2),
    ],
    ids=["default", "pointer-loads", "persistent", "tma-persistent", "grouped", "grouped-pers"],
)
def test_gpu_triton_top2_equals_topk(cfg):
    from bench.gpu_checks import check_top2_kernel

    if cfg is not None and cfg.tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    for n in (256, 1024):
        check_top2_kernel(n, vocab=131072, dim=2688, seed=n, cfg=cfg)
    check_top2_kernel(300, vocab=5000, dim=200, seed=1, ties=True, cfg=cfg)
    check_top2_kernel(16, vocab=70000, dim=64, seed=2, ties=True, cfg=cfg)  # splits, tails
    check_top2_kernel(2048, vocab=16384, dim=384, seed=5, ties=True, cfg=cfg)  # the prose base


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_gpu_triton_top2_fp32(precision):
    """fp32 inputs, the fused head's dtype: TF32 or exact dots, ties still lowest-id."""
    from bench.gpu_checks import check_top2_kernel

    cfg = Top2Config(precision=precision)
    f32 = dict(cfg=cfg, dtype=torch.float32)
    check_top2_kernel(8192, vocab=131072, dim=256, seed=3, **f32)  # d_r 256: the fused head
    check_top2_kernel(1000, vocab=20000, dim=256, seed=4, **f32)
    check_top2_kernel(300, vocab=5000, dim=200, seed=1, ties=True, **f32)


@needs_cuda
def test_gpu_fused_attention_equals_sdpa():
    from bench.gpu_checks import check_fused_attention

    check_fused_attention()


@needs_cuda
def test_gpu_fused_attention_runs_a_rope_decoder():
    from bench.gpu_checks import check_fused_attention_rope

    check_fused_attention_rope()


@needs_cuda
def test_gpu_engine_serves_tf32_and_the_fused_attention(served):
    from stateblock.model.kernels.attention import available as attention_available

    eng = TorchEngine.load(served, device="cuda")
    # TF32 in the kernels' own dots; torch's process-wide switch left alone
    assert eng._kernel_precision == "tf32" and eng._precision == "highest"
    assert eng.head == "fused"
    assert eng._head.shape == (served.lm_head.shape[0], eng._decoder.cfg.d_r)
    assert eng.attention == ("fused" if attention_available("cuda") else "sdpa")


@needs_cuda
def test_gpu_engine_equals_reference_modulo_near_ties(served, captured):
    from bench.gpu_checks import check_engine_parity

    check_engine_parity(served, captured)


@needs_cuda
def test_gpu_exact_path_equals_reference_modulo_near_ties(served, captured):
    """The default engine runs plain greedy cohorts in bf16; with it off (float32) every
    cohort takes the exact path, which must hold as well."""
    from bench.gpu_checks import check_engine_parity

    check_engine_parity(served, captured, greedy_dtype="float32")


@needs_cuda
def test_gpu_graph_replay_equals_eager(served, captured):
    from bench.gpu_checks import check_graph_vs_eager

    check_graph_vs_eager(served, captured)


@needs_cuda
def test_gpu_a_block_reads_the_same_bits_alone_and_in_company(served, captured):
    from bench.gpu_checks import check_company_invariance

    check_company_invariance(served, captured)


@needs_cuda
def test_gpu_logprob_lanes_run_exact_dots_within_the_gate(served, captured):
    from bench.gpu_checks import check_logprob_precision

    check_logprob_precision(served, captured)


@needs_cuda
def test_gpu_beside_reads_as_its_engine_while_both_run(served, captured):
    from bench.gpu_checks import check_beside

    check_beside(served, captured)


@needs_cuda
def test_gpu_warmed_up_to_the_limits_no_request_records_a_graph(served, captured):
    """With `warm_up_to` (the readout service's request limits), warm_up records every shape
    and precision path a request can take: readouts at the limits, greedy, sampled and with
    log-probabilities, record nothing more."""
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import sampling_params

    eng = TorchEngine.load(served, device="cuda", warm_up_to=(1000, 300))
    eng.warm_up()
    recorded = set(eng._graphs)
    assert len(recorded) >= 2 * 8  # 4 prompt buckets x 2 depth buckets, two paths at least
    rows = captured[0].to("cuda")
    long_rows = rows.repeat(1000 // rows.shape[0] + 1, 1)[:1000]
    for lane_rows, depth in ((rows, 16), (long_rows, 300), (long_rows[:300], 200)):
        for sampling in (sampling_params(0.0, None), sampling_params(0.7, 3)):
            eng.readout([LaneRequest(rows=lane_rows, depth=depth, sampling=sampling)])
        logprobs = sampling_params(0.0, None)
        logprobs.logprobs.SetInParent()
        eng.readout([LaneRequest(rows=lane_rows, depth=depth, sampling=logprobs)])
    assert set(eng._graphs) == recorded
