"""The `torch` readout engine: parity with the reference engine, bucket padding, fused top-2.

CPU tests run the engine's eager fp32 path on the shipped model; the GPU tests (Triton
kernel, bf16 + CUDA graphs) share their checks with `bench/gpu_smoke.py` and skip cleanly
without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from stateblock.engines import LaneRequest, create_engine
from stateblock.engines.torch_engine import (
    EngineUnavailable,
    Shape,
    TorchEngine,
    TorchEngineOptions,
    bucket,
    execution_lanes,
    fused_head,
    matmul_precision,
    reachable_shapes,
)
from stateblock.model.kernels.top2 import (
    Top2Config,
    default_config,
    merge_top2,
    top2,
    top2_reference,
)
from stateblock.model.vocab import NO_EOS
from tests.engine_fixtures import assert_same, lanes_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- the engine on the CPU ----------------------------------------------------------------
def test_registered_and_loadable(served):
    eng = create_engine("torch", served)
    assert isinstance(eng, TorchEngine) and eng.name == "torch"
    assert eng.identity == served.identity
    assert eng.top2_backend == "torch-chunked"  # no GPU here: the chunked PyTorch top-2
    eng.warm_up()


def test_greedy_lanes_equal_reference(reference, engine, captured):
    lanes = lanes_of(captured, [1, 40, 300, 7, 128])
    ref, out = reference.readout(lanes), engine.readout(lanes)
    worst = assert_same(ref, out)
    assert any(r.eos_pos != NO_EOS for r in ref)  # some lane really stops at EOS
    print(f"greedy: 5 lanes, max margin diff {worst:.2e}")


def test_seeded_sampling_equals_reference(reference, engine, captured):
    lanes = lanes_of(
        captured,
        [64, 200, 33, 150],
        temps=[0.0, 1.5, 0.7, 3.0],
        seeds=[None, 11, 12, 13],
    )
    ref, out = reference.readout(lanes), engine.readout(lanes)
    assert_same(ref, out)
    again = engine.readout(lanes)
    assert [r.token_ids for r in again] == [r.token_ids for r in out]  # a seed reproduces
    greedy = engine.readout(lanes_of(captured, [64, 200, 33, 150]))
    assert out[3].token_ids != greedy[3].token_ids  # temperature 3 actually samples


def test_fused_head_reads_the_same_logits(served, reference, captured):
    """head="fused" (the GPU default) multiplies the mixer's normed output by the precomputed
    lm_head @ out.weight: the same logits by associativity, so in fp32 the same greedy and
    seeded answers as the reference, whose hidden states meet the lm_head itself."""
    eng = TorchEngine.load(served, head="fused")
    dec = eng._decoder
    assert eng._head.shape == (served.lm_head.shape[0], dec.cfg.d_r)
    want = (served.lm_head.double() @ dec.out.weight.double()).float()  # exact, then rounded
    got = fused_head(served.lm_head, dec.out.weight, torch.float32)
    assert torch.allclose(got, want, rtol=2.5e-7, atol=1e-12)  # at most the last fp32 bit
    assert torch.allclose(want, served.lm_head.float() @ dec.out.weight.float(), atol=1e-5)
    lanes = lanes_of(captured, [1, 40, 300, 7, 128], temps=[0, 0, 1.5, 0, 0.7],
                     seeds=[None, None, 21, None, 22])  # fmt: skip
    worst = assert_same(reference.readout(lanes), eng.readout(lanes), atol=1e-3)
    print(f"fused head: 5 lanes, max margin diff {worst:.2e}")
    with pytest.raises(ValueError, match="head must be"):
        TorchEngine.load(served, head="logits")


def test_depth_and_prompt_bucket_padding_is_exact(served, engine, captured):
    padded = TorchEngine.load(
        served,
        lane_buckets=(1, 2, 4, 8),
        prompt_buckets=(8, 32, 128),
        depth_buckets=(16, 64, 512),
    )
    lanes = lanes_of(captured, [3, 40, 300], temps=[0.0, 0.9, 0.0], seeds=[None, 5, None])
    shape, bucketed = padded._shape(lanes)
    assert bucketed and shape.lanes == 8 and shape.depth == 512  # 8 x 512 <= LANE_POSITIONS
    assert shape.prompt > max(lane.rows.shape[0] for lane in lanes)
    worst = assert_same(engine.readout(lanes), padded.readout(lanes))
    print(f"bucket padding: max margin diff {worst:.2e}")


def test_reachable_shapes_are_every_bucket_a_request_within_the_limits_can_hit():
    """The served warm-up's shapes: each prompt bucket up to the prompt limit's, each depth
    bucket up to the depth limit's, at that depth's execution lanes; limits beyond the
    buckets stop at the largest (longer lanes run eagerly)."""
    lanes, prompts, depths = (1, 2, 4, 8), (64, 256, 512, 1024, 2048, 4096), (256, 1024, 8192)
    every = reachable_shapes(4096, 8192, lanes, prompts, depths)
    assert len(every) == 18 and len(set(every)) == 18
    assert {(s.prompt, s.depth) for s in every} == {(p, d) for p in prompts for d in depths}
    assert all(s.lanes == execution_lanes(s.depth, lanes) for s in every)
    assert reachable_shapes(600, 300, lanes, prompts, depths) == tuple(
        Shape(8, p, d) for d in (256, 1024) for p in (64, 256, 512, 1024)
    )
    assert reachable_shapes(10_000, 10_000, lanes, prompts, depths) == every
    assert reachable_shapes(4096, 8192, (), (), ()) == ()  # the CPU: no buckets, no graphs


def test_a_lanes_shape_and_answer_do_not_depend_on_its_company(served, captured):
    """The execution shape is fixed by the depth bucket (on a GPU, kernels and their float
    sums follow the shape): a lane reads the same bits alone as among others' lanes."""
    eng = TorchEngine.load(
        served, lane_buckets=(1, 2, 4, 8), prompt_buckets=(256,), depth_buckets=(16, 64, 512)
    )
    assert [execution_lanes(d, (1, 2, 4, 8)) for d in (256, 1024, 2048, 4096, 8192)] == [
        8, 8, 4, 2, 1,
    ]  # fmt: skip
    lane = LaneRequest(rows=captured[0], depth=40)
    alone = eng.readout([lane])[0]
    for others in (1, 3, 7):
        company = [LaneRequest(rows=captured[1 + i % 3], depth=33 + i) for i in range(others)]
        lanes = [*company[:1], lane, *company[1:]]
        assert eng._shape(lanes) == eng._shape([lane]) == (Shape(8, 256, 64), True)
        assert eng.cohort_key(lanes) == eng.cohort_key([lane])
        got = eng.readout(lanes)[1]
        assert (got.token_ids, got.eos_pos, got.margins) == (
            alone.token_ids,
            alone.eos_pos,
            alone.margins,
        )


def test_beside_reads_as_its_engine_while_both_run(engine, captured):
    """`beside()` shares the weights, not the lock: it reads a long block while the engine
    reads short ones from another thread, each answer bit for bit the engine's alone."""
    import threading

    other = engine.beside()
    assert other._lock is not engine._lock and other._graphs is not engine._graphs
    long = lanes_of(captured[:3], [300, 299, 298])
    shorts = [lanes_of(captured[i : i + 1], [24 + i]) for i in range(4)]
    want_long, want_shorts = engine.readout(long), [engine.readout(b) for b in shorts]
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(other.readout(long)))
    worker.start()
    got_shorts = [engine.readout(b) for b in shorts]
    worker.join(60)
    assert got == want_long and got_shorts == want_shorts


def test_mixer_is_prefix_causal(engine, captured):
    """Positions < D do not depend on positions added after them: the padding argument."""
    dec = engine._decoder
    rows = torch.nn.utils.rnn.pad_sequence(captured[:3], batch_first=True)
    lens = torch.tensor([r.shape[0] for r in captured[:3]])
    guess = dec.guess_embed(engine._lm_head) if dec.cfg.refine else None  # refining decoders
    with torch.inference_mode():
        short = dec.hidden(rows, lens, torch.arange(50).expand(3, -1), guess=guess)
        long = dec.hidden(rows, lens, torch.arange(700).expand(3, -1), guess=guess)
    diff = (short - long[:, :50]).abs().max().item()
    print(f"hidden[:50] at D=50 vs D=700: max abs diff {diff:.2e}")
    assert diff < 1e-4 * max(1.0, short.abs().max().item())


def test_cohorts_larger_than_k_max_and_shapes_beyond_buckets(served, reference, captured):
    small = TorchEngine.load(
        served,
        lane_buckets=(1, 2, 4),
        prompt_buckets=(64,),
        depth_buckets=(32,),
    )
    depths = [5, 31, 33, 80, 2, 17, 32, 9, 60, 1]  # 10 lanes: cohorts of 4, 4, 2
    lanes = lanes_of(captured, depths)
    assert_same(reference.readout(lanes), small.readout(lanes))


def test_bad_lanes_are_rejected(engine, captured):
    with pytest.raises(ValueError):
        engine.readout([LaneRequest(rows=torch.zeros(3, 5), depth=4)])
    with pytest.raises(ValueError):
        engine.readout([LaneRequest(rows=captured[0], depth=0)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_fails_clearly(served):
    with pytest.raises(EngineUnavailable, match="no CUDA device"):
        TorchEngine.load(served, device="cuda")
    with pytest.raises(EngineUnavailable, match="no CUDA device"):
        create_engine("torch", served, "cuda")


def test_a_cohort_asking_for_logprobs_runs_at_the_logprob_precision(served, captured):
    """TF32 kernels put log-probabilities 1e-2 nats off on the H200: a cohort with a lane
    that asks for them runs its kernels' dots at `logprob_precision` (exact by default), the
    others at `kernel_precision`. Both come back with the same answer here (the CPU has no
    TF32), so what is checked is the precision each cohort ran at."""
    from stateblock.protocol.sampling import sampling_params

    eng = TorchEngine.load(served, kernel_precision="tf32")
    ran: list[str] = []
    step = eng._step
    eng._step = lambda precision, *a: ran.append(precision) or step(precision, *a)
    plain = lanes_of(captured, [40, 12])
    asks = [LaneRequest(rows=plain[0].rows, depth=40, sampling=sampling_params(logprobs=1))]
    a, b = eng.readout(plain), eng.readout(plain[1:] + asks)
    assert ran == ["tf32", "ieee"]
    assert a[0].logprobs is None and b[1].logprobs is not None and b[0].logprobs is None
    assert b[1].token_ids == a[0].token_ids
    with pytest.raises(ValueError, match="logprob_precision"):
        TorchEngine.load(served, logprob_precision="bf16")


def test_the_greedy_fast_path_takes_plain_greedy_cohorts_only(served, reference, captured):
    """`greedy_dtype`: a cohort of plain greedy lanes runs the bf16 copy (its tokens the
    reference's but where the reference's top two are within the audit's near-tie bound; its
    margins visibly rounded); a cohort that samples or asks for log-probabilities runs the
    exact path, so those stay the reference's."""
    from stateblock.protocol.sampling import sampling_params

    eng = TorchEngine.load(served, head="fused", greedy_dtype="bfloat16")
    assert eng._greedy[0].out.weight.dtype == torch.bfloat16
    assert eng._decoder.out.weight.dtype == torch.float32  # the exact path is untouched
    ran: list[str] = []
    step = eng._step
    eng._step = lambda precision, *a: ran.append(precision) or step(precision, *a)
    plain = lanes_of(captured, [1, 40, 120, 7])
    ref, fast = reference.readout(plain), eng.readout(plain)
    rounded = 0.0
    for r, f in zip(ref, fast, strict=True):
        assert f.eos_pos == r.eos_pos
        for i, (a, b) in enumerate(zip(r.token_ids, f.token_ids, strict=True)):
            assert a == b or r.margins[i] < 0.05, (i, a, b, r.margins[i])
        rounded = max(rounded, max(abs(p - q) for p, q in zip(r.margins, f.margins, strict=True)))
    assert rounded > 1e-4  # bf16 really ran
    sampled = lanes_of(captured, [40, 12], temps=[0.0, 1.5], seeds=[None, 3])
    asks = [LaneRequest(rows=plain[1].rows, depth=40, sampling=sampling_params(logprobs=1))]
    assert_same(reference.readout(sampled), eng.readout(sampled))
    assert_same(reference.readout(asks), eng.readout(asks))
    assert ran == ["greedy", "ieee", "ieee"]
    with pytest.raises(ValueError, match="greedy_dtype"):
        TorchEngine.load(served, greedy_dtype="int8")
    with pytest.raises(ValueError, match="greedy_dtype"):  # the norms' squares overflow it
        TorchEngine.load(served, greedy_dtype=torch.float16)
    # "float32" keeps every cohort exact; the CPU's default is that too (the GPU's is bf16)
    assert TorchEngine.load(served, greedy_dtype="float32")._greedy is None
    assert TorchEngine.load(served)._greedy is None


def test_cpu_engine_runs_the_reference_numerics(served, engine):
    """On the CPU the engine computes as the reference does: fp32 matmuls, SDPA attention;
    asking for the GPU-only fused kernel fails clearly instead of falling back."""
    assert engine.attention == "sdpa" and engine._precision == "highest"
    assert engine._kernel_precision == "ieee"
    with pytest.raises(EngineUnavailable, match="fused attention kernel needs"):
        TorchEngine.load(served, attention="fused")
    with pytest.raises(ValueError, match="matmul_precision"):
        TorchEngine.load(served, matmul_precision="medium")


def test_matmul_precision_is_scoped():
    before = torch.get_float32_matmul_precision()
    with matmul_precision("high"):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(ValueError), matmul_precision("low"):
        pass
    assert torch.get_float32_matmul_precision() == before


def test_dot_precision_is_per_thread():
    """The fused kernels' TF32 choice is a context variable: another thread, such as a
    capture service's forward in the same process, never sees it."""
    import threading

    from stateblock.model.kernels.attention import dot_precision, resolve_precision

    seen = {}
    with dot_precision("tf32"):
        assert resolve_precision() == "tf32" and resolve_precision("ieee") == "ieee"
        t = threading.Thread(target=lambda: seen.update(other=resolve_precision()))
        t.start()
        t.join()
    assert seen["other"] == "ieee"  # torch's own default ("highest") there
    assert resolve_precision() == "ieee"
    with pytest.raises(ValueError), dot_precision("bf16"):
        pass


def test_fused_impl_without_a_prefix_mask_is_sdpa(served, captured):
    """impl="fused" changes only the mixer's PrefixCausal attention: the pooling and repair
    (a row mask, no mask) stay SDPA, so encode() is identical on any device."""
    dec = TorchEngine.load(served)._decoder
    rows = captured[0][None].float()
    lens = torch.tensor([rows.shape[1]])
    with torch.inference_mode():
        assert torch.equal(dec.encode(rows, lens, "fused"), dec.encode(rows, lens, "sdpa"))


def test_bucket_choice():
    assert bucket(1, (256, 1024)) == 256 and bucket(256, (256, 1024)) == 256
    assert bucket(257, (256, 1024)) == 1024 and bucket(1025, (256, 1024)) is None
    assert bucket(3, ()) is None
    assert Shape(1, 512, 256) == Shape(1, 512, 256)


# -- the top-2 on the CPU -----------------------------------------------------------------
def test_fallback_top2_equals_topk():
    g = torch.Generator().manual_seed(0)
    for n, v, d in [(37, 1000, 64), (5, 131, 48), (1, 64, 256)]:
        h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
        full_v, full_i = torch.topk(h @ w.t(), 2, dim=-1)
        for got_v, got_i in (top2_reference(h, w), top2(h, w)):  # top2 dispatches here
            assert got_v.dtype == torch.float32 and got_i.dtype == torch.int64
            assert torch.equal(got_i, full_i)
            assert torch.allclose(got_v, full_v, atol=1e-5)


def test_merge_top2_lowest_id_wins_ties():
    vals = torch.tensor([[[3.0, 1.0]], [[3.0, 2.0]], [[1.0, 0.0]]])  # (S=3, N=1, 2)
    ids = torch.tensor([[[5, 7]], [[2, 9]], [[20, 21]]])
    v, i = merge_top2(vals, ids)
    assert v.tolist() == [[3.0, 3.0]] and i.tolist() == [[2, 5]]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 64, generator=g)
    per = [torch.topk(c, 2, dim=-1) for c in logits.split(16, dim=-1)]
    sv = torch.stack([p.values for p in per])
    si = torch.stack([p.indices + 16 * s for s, p in enumerate(per)])
    mv, mi = merge_top2(sv, si)
    fv, fi = torch.topk(logits, 2, dim=-1)
    assert torch.equal(mi, fi) and torch.equal(mv, fv)


def test_default_config_fills_the_gpu():
    """H200 (132 SMs), V=131072: every D gets a last wave of programs >= 95% full; from 16
    row blocks up, groups of 16 row blocks x 8 splits."""
    for n, split, group in [(256, 64, 0), (1024, 16, 0), (2048, 8, 16), (8192, 8, 16),
                            (65536, 8, 16)]:  # fmt: skip
        cfg = default_config(n, 131072, 132)
        programs = -(-n // cfg.block_n) * cfg.n_split
        waves = programs / 132
        assert (cfg.n_split, cfg.group_rows) == (split, group), (n, cfg)
        assert waves / -(-waves // 1) >= 0.95, (n, cfg)
        assert 131072 // cfg.n_split >= 4 * cfg.block_v  # >= 4 lm_head tiles per program
    assert default_config(8, 64, 132).n_split == 1  # a tiny vocabulary is not split
    assert 2688 % Top2Config().block_k == 0  # d_base 2688 takes the unmasked d loop


# -- a refining, row-attending decoder (the rebuilt architecture) -------------------------
# the shipped one (rope), one without rope, and a deeper refinement stack
ARCHS = [{"rope": False}, {"rope": True}, {"rope": True, "n_ref_mixer": 3}]


@pytest.mark.parametrize("arch", ARCHS, ids=["sinusoid", "rope", "rope-deeper-refine"])
@pytest.mark.parametrize("head", ["lm_head", "fused"])
def test_refining_decoder_equals_reference(head, arch):
    """The engine's refinement reads its first guess through a (V, d_r) gather table built at
    start-up; the reference projects the lm_head row of the guess per call: same answers."""
    import copy

    from stateblock.engines import ReferenceEngine
    from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
    from stateblock.protocol.envelope import ModelIdentity

    torch.manual_seed(0)
    cfg = ReadoutConfig(d_base=48, vocab_size=97, eos_token_id=5, d_r=32, n_latent=4,
                        n_heads=4, n_mixer=2, row_attn=True, refine=1, **arch)  # fmt: skip
    dec = ReadoutDecoder(cfg).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.3)
    lm_head = torch.randn(97, 48)
    ident = ModelIdentity("m", b"b" * 32, b"l" * 32, b"d" * 32)
    ref = ReferenceEngine(copy.deepcopy(dec), lm_head, ident, eos_token_id=5)
    opts = TorchEngineOptions(head=head)
    eng = TorchEngine(copy.deepcopy(dec), lm_head, ident, eos_token_id=5, options=opts)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(n, 48, generator=g) for n in (3, 11, 6)]
    lanes = lanes_of(rows, [70, 9, 33, 120], temps=[0, 0, 1.2, 0], seeds=[None, None, 4, None])
    want, got = ref.readout(lanes), eng.readout(lanes)
    assert_same(want, got, atol=1e-3)
    assert eng._guess_table is not None and eng._guess_table.shape == (97, 32)
    # the candidate filters: the same selection in both engines, EOS held back by min_tokens
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import sampling_params

    lm_eos = lm_head.clone()
    lm_eos[5] = 3 * lm_head[got[0].token_ids[3]]  # EOS wins where that token won
    ref = ReferenceEngine(copy.deepcopy(dec), lm_eos, ident, eos_token_id=5)
    opts = TorchEngineOptions(head=head)
    eng = TorchEngine(copy.deepcopy(dec), lm_eos, ident, eos_token_id=5, options=opts)
    params = [sampling_params(0.0, min_tokens=40, logprobs=2), sampling_params(1.0, 5, top_k=2, logprobs=1),
              sampling_params(0.7, 6, top_p=0.6, min_p=0.2), sampling_params(0.0, logprobs=0)]  # fmt: skip
    lanes = [
        LaneRequest(rows=r, depth=60, sampling=sp)
        for r, sp in zip([*rows, rows[0]], params, strict=True)
    ]
    want, got = ref.readout(lanes), eng.readout(lanes)
    assert_same(want, got, atol=1e-3)
    assert got[3].eos_pos < 40 <= len(got[0].token_ids)  # lane 3: lane 0 without min_tokens
    assert got[2].logprobs is None and got[1].logprobs is not None
    lp = got[1].logprobs  # a sampled lane: its tokens are not all the top-1, nor their logprobs
    assert len(lp.token) == len(got[1].margins) and max(lp.token) <= 0.0
    assert any(t != a for t, a in zip(lp.token, lp.top1, strict=True))


def test_the_parity_check_excuses_a_real_mismatch_only_after_a_first_guess_near_tie(
    reference, engine, captured
):
    """bench.gpu_checks (the GPU parity check): a difference where the final margin is not a
    near-tie fails, unless the two first guesses (a refining decoder's first pass) already
    split at or before it, and only at first-guess near-ties."""
    from bench.gpu_checks import FirstGuess, compare_near_ties, engine_first_guess, first_pass
    from stateblock.engines.base import LaneResult

    lanes = lanes_of(captured, [30, 12])
    ids, margins = first_pass(reference._decoder, reference._lm_head, lanes[0])
    assert len(ids) == len(margins) == 30 and min(margins) >= 0.0
    # fp32 both: the same first guess, lane by lane, out of the cohort the readout makes
    other = first_pass(reference._decoder, reference._lm_head, lanes[1])[0]
    assert engine_first_guess(engine, lanes) == [ids, other]
    ref = [LaneResult((5, 6, 7), NO_EOS, (1.0, 2.0, 0.01))]
    assert compare_near_ties(ref, [LaneResult((5, 6, 9), NO_EOS, (1.0, 2.0, 0.01))]) == {
        "positions": 3, "mismatches": 1, "near_tie_mismatches": 1, "worst_margin": 0.01,
    }  # fmt: skip
    real = [LaneResult((5, 8, 7), NO_EOS, (1.0, 2.0, 0.01))]  # differs where the margin is 2.0
    with pytest.raises(AssertionError) as failed:
        compare_near_ties(ref, real)
    # the failure names the position, both margins and (no first guess given) no splits
    assert "'t': 1, 'ref_margin': 2.0, 'out_margin': 2.0" in str(failed.value)
    guess = [1, 2, 3]
    excused = FirstGuess(guess, [1.0, 0.02, 3.0], [1, 4, 3])  # split at 1, a near-tie
    stats = compare_near_ties(ref, real, first=lambda i: excused)
    assert stats["after_a_first_guess_near_tie"] == 1
    for first in (
        FirstGuess(guess, [1.0, 0.9, 3.0], [1, 4, 3]),  # split at 1, no near-tie
        FirstGuess(guess, [0.01, 0.02, 3.0], guess),  # near-ties, no split
        FirstGuess(guess, [1.0, 2.0, 0.01], [1, 2, 4]),  # split after the mismatch only
        FirstGuess(guess, [0.01, 0.9, 3.0], [4, 4, 3]),  # split at 0 (near) and 1 (not)
    ):
        with pytest.raises(AssertionError) as failed:
            compare_near_ties(ref, real, first=lambda i, f=first: f)
        assert f"'first_guess_splits': {first.splits(1)}" in str(failed.value)
    assert FirstGuess(guess, [0.01, 0.9, 3.0], [4, 4, 3]).splits(1) == [(0, 0.01), (1, 0.9)]


def test_lanes_of_one_prompt_move_their_rows_once():
    """Lanes that read the same rows of a block (`n` > 1 of one prompt) get one copy of them
    on the device; other lanes' rows, equal or not, are moved apart."""
    from stateblock.engines.torch_step import lanes_on

    block = torch.randn(7, 4)
    shared = [LaneRequest(rows=block[0:3], depth=5), LaneRequest(rows=block[0:3], depth=9)]
    other = [LaneRequest(rows=block[3:6], depth=5), LaneRequest(rows=block[0:3].clone(), depth=5)]
    moved = lanes_on([*shared, *other], "meta")
    assert all(lane.rows.device.type == "meta" for lane in moved)
    assert moved[0].rows is moved[1].rows
    assert len({id(lane.rows) for lane in moved}) == 3
    assert [lane.depth for lane in moved] == [5, 9, 5, 5]
