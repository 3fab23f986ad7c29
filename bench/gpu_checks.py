"""GPU correctness checks of the `torch` engine's kernels and graphs, shared by
`bench/gpu_smoke.py` and the GPU tests of tests/unit/engines/test_torch_engine.py (CPU) and tests/gpu/test_torch_engine_gpu.py. Each raises
AssertionError on a failure and returns what it compared."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

NEAR_TIE = (
    0.05  # docs/ARCHITECTURE.md: reference top-1 minus top-2 margin under which a flip is allowed
)
V, D_BASE = 131072, 2688


def random_weights(arch: dict | None = None) -> tuple:
    """A random decoder at the seed's scale (d_base 2688, V 131072) with the shipped decoder's
    architecture (recipe.DECODER_CONFIG: row attention, one refinement pass, rotary
    positions, two mixers) unless `arch` says otherwise ({} is the latents-only default)."""
    from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
    from stateblock.train.recipe import DECODER_CONFIG

    torch.manual_seed(0)
    eos = 2
    arch = DECODER_CONFIG if arch is None else arch
    dec = ReadoutDecoder(ReadoutConfig(d_base=D_BASE, vocab_size=V, eos_token_id=eos, **arch))
    lm_head = (torch.randn(V, D_BASE, device="cuda") * 0.05).bfloat16()
    lm_head[eos] = 0  # EOS logit exactly 0 < the top-1: every lane reads its whole depth
    # fp32 like the engine's decoder (it would convert it in place anyway); lm_head in bf16
    return dec.cuda().float().eval().requires_grad_(False), lm_head, eos


def check_top2_kernel(
    n: int,
    vocab: int,
    dim: int,
    seed: int,
    ties: bool = False,
    cfg=None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
):
    """Kernel vs an fp32 torch.topk: the chosen ids' logits within 1e-3 relative of the true
    top-1 / top-2 (TF32 dots on fp32 inputs: 5e-3); on exact ties (integer inputs),
    exactly the lowest ids."""
    from stateblock.model.kernels.top2 import top2_triton

    g = torch.Generator(device=device).manual_seed(seed)
    if ties:  # small integers: exact products and sums, many exactly equal logits
        h = torch.randint(-2, 3, (n, dim), generator=g, device=device).to(dtype)
        w = torch.randint(-1, 2, (vocab, dim), generator=g, device=device).to(dtype)
        w[vocab // 2 :] = w[: vocab - vocab // 2].clone()  # ties across tiles and splits
    else:
        h = torch.randn(n, dim, generator=g, device=device).to(dtype)
        w = (torch.randn(vocab, dim, generator=g, device=device) * 0.05).to(dtype)
    val, idx = top2_triton(h, w, cfg)
    logits = h.float() @ w.float().t()  # (n, V) fp32 truth
    # the log-sum-exp folded in the same pass (online softmax, merged over splits): same
    # top-2, and exact log-probabilities (1e-3 nats; TF32 dots: 1e-2)
    v2, i2, lse = top2_triton(h, w, cfg, lse=True)
    assert torch.equal(v2, val) and torch.equal(i2, idx), "lse=True changed the top-2"
    lse_err = (lse - torch.logsumexp(logits, dim=-1)).abs().max().item()
    lse_tol = 1e-2 if dtype == torch.float32 and (cfg is None or cfg.precision == "tf32") else 1e-3
    assert lse_err < lse_tol, ("lse", lse_err)
    if ties:
        ref_v, ref_i = torch.sort(logits, dim=-1, descending=True, stable=True)
        assert torch.equal(idx, ref_i[:, :2]), "exact ties: not the lowest ids"
        assert torch.equal(val, ref_v[:, :2])
        return {
            "n": n,
            "vocab": vocab,
            "dim": dim,
            "ties": True,
            "tied_rows": int((ref_v[:, 0] == ref_v[:, 1]).sum()),
            "lse_abs_err_max": lse_err,
        }
    true_v, true_i = logits.topk(2, dim=-1)
    assert bool(((idx >= 0) & (idx < vocab)).all()), "ids out of range: unwritten output?"
    assert bool((idx[:, 0] != idx[:, 1]).all())
    chosen = logits.gather(1, idx)  # the truth at the kernel's ids
    rel = ((true_v - chosen) / true_v.abs().clamp_min(1e-6)).max().item()
    val_err = ((val - true_v).abs() / true_v.abs().clamp_min(1e-6)).max().item()
    tf32 = dtype == torch.float32 and (cfg is None or cfg.precision == "tf32")
    tol = 5e-3 if tf32 else 1e-3
    assert rel < tol and val_err < tol, (rel, val_err)
    return {
        "n": n,
        "vocab": vocab,
        "dim": dim,
        "id_mismatch_frac": (idx != true_i).float().mean().item(),
        "chosen_rel_gap_max": rel,
        "value_rel_err_max": val_err,
        "lse_abs_err_max": lse_err,
    }


def compare_near_ties(ref, out, first=None) -> dict:
    """Lane results: any token or EOS difference must sit where the reference's margin is
    under NEAR_TIE. Returns counts; raises AssertionError on a real mismatch.

    `first(i)`, given for a refining decoder, is lane i's `FirstGuess`. Its final token at t
    reads the first guess at every position up to t (prefix-causal), and a guess is a
    discrete top-1 whose own near-ties the final margin does not show. So a difference where
    the final margin is not a near-tie is excused only when the two first guesses already
    differ at or before t and every such difference sits at a first-guess near-tie: the first
    discrete decision the two took apart was a near-tie, as when greedy decoding splits."""
    stats = {"positions": 0, "mismatches": 0, "near_tie_mismatches": 0, "worst_margin": 0.0}
    if first is not None:
        stats["after_a_first_guess_near_tie"] = 0
    real: list[dict] = []
    for i, (a, b) in enumerate(zip(ref, out, strict=True)):
        n = min(len(a.token_ids), len(b.token_ids))
        stats["positions"] += n
        diffs = [t for t in range(n) if a.token_ids[t] != b.token_ids[t]]
        if a.eos_pos != b.eos_pos:
            diffs.append(min(a.eos_pos, b.eos_pos))
        for t in diffs:
            stats["mismatches"] += 1
            m = a.margins[t]
            stats["worst_margin"] = max(stats["worst_margin"], m)
            stats["near_tie_mismatches"] += m < NEAR_TIE
            if m < NEAR_TIE:
                continue
            fg = first(i) if first is not None else None
            if fg is not None and fg.splits_at_a_near_tie(t):
                stats["after_a_first_guess_near_tie"] += 1
                continue
            # what a failed GPU run needs to say in its one line of output
            real.append({"lane": i, "t": t, "ref_margin": round(m, 4),
                         "out_margin": round(b.margins[t], 4) if t < len(b.margins) else None,
                         "eos": (a.eos_pos, b.eos_pos),
                         "first_guess_splits": [(s, round(fm, 4)) for s, fm in fg.splits(t)[:8]]
                         if fg else None})  # fmt: skip
    assert not real, {**stats, "real": real[:6]}
    return stats


@dataclass(frozen=True)
class FirstGuess:
    """One lane's first guess (a refining decoder's first pass), per read position: the
    reference's top-1 ids and top-1 minus top-2 margins, and the engine's top-1 ids."""

    ref_ids: list[int]
    margins: list[float]
    engine_ids: list[int]

    def splits(self, t: int) -> list[tuple[int, float]]:
        """(position, reference first-pass margin) of every split at or before t."""
        n = min(t + 1, len(self.ref_ids), len(self.engine_ids))
        return [(s, self.margins[s]) for s in range(n)
                if self.ref_ids[s] != self.engine_ids[s]]  # fmt: skip

    def splits_at_a_near_tie(self, t: int) -> bool:
        flips = self.splits(t)
        return bool(flips) and all(m < NEAR_TIE for _, m in flips)


@torch.no_grad()
def first_pass(decoder, lm_head: torch.Tensor, lane) -> tuple[list[int], list[float]]:
    """A refining decoder's first guess for one lane as the reference engine makes it (its
    decoder's states against its lm_head, chunked like `guess_embed`): the top-1 id and the
    top-1 minus top-2 margin at every read position."""
    from stateblock.model.vocab import chunked_topk

    dev = lm_head.device
    rows = lane.rows.to(dev, torch.float32).unsqueeze(0)  # (1, P, d_base)
    pos = torch.arange(lane.depth, device=dev).unsqueeze(0)  # (1, D)
    lens = torch.tensor([rows.shape[1]], device=dev)
    states = decoder.passes(rows, lens, pos, guess=decoder.guess_embed(lm_head))
    h = decoder.out(states[0]).to(lm_head.dtype)  # (1, D, d_base)
    v, ids = chunked_topk(h, lm_head, decoder.cfg.n_chunks, 2)  # (1, D, 2)
    return ids[0, :, 0].tolist(), (v[0, :, 0] - v[0, :, 1]).float().tolist()


@torch.inference_mode()
def engine_first_guess(eng, lanes) -> list[list[int]]:
    """The torch engine's own first guess for each lane (top-1 ids up to its depth), in the
    cohorts its readout makes of these lanes and on the path it picks for each, run eagerly
    at the same padded shape (a graph replays the same step: check_graph_vs_eager). The
    guess is the first of the step's two top-2 calls."""
    guesses: list[list[int]] = []
    for lo in range(0, len(lanes), eng._k_max):
        cohort = lanes[lo : lo + eng._k_max]
        shape, _ = eng._shape(cohort)
        precision = eng._path(cohort)
        top2, calls = eng._top2[precision], []

        def recording(x, head, top2=top2, calls=calls, **kw):
            out = top2(x, head, **kw)
            calls.append(out[1])
            return out

        eng._top2[precision] = recording
        try:
            eng._eager(shape, precision, cohort)
        finally:
            eng._top2[precision] = top2
        ids = calls[0][:, 0].view(shape.lanes, shape.depth).cpu()
        guesses += [ids[i, : lane.depth].tolist() for i, lane in enumerate(cohort)]
    return guesses


def first_guesses(eng, ref_lm_head: torch.Tensor, lanes):
    """`compare_near_ties`' `first` for a refining decoder (None otherwise): lane i's
    FirstGuess, computed only once a lane has a real mismatch (the engine's for every lane
    at once, in the cohorts its readout ran)."""
    if not eng._decoder.cfg.refine:
        return None
    engine = functools.cache(lambda: engine_first_guess(eng, lanes))

    @functools.cache
    def first(i: int) -> FirstGuess:
        ids, margins = first_pass(eng._decoder, ref_lm_head, lanes[i])
        return FirstGuess(ids, margins, engine()[i])

    return first


def shipped_engines(served, device: str = "cuda", **options):
    """TorchEngine (bf16, CUDA graphs) and a bf16 ReferenceEngine sharing its weights."""
    from stateblock.engines import ReferenceEngine
    from stateblock.engines.torch_engine import TorchEngine

    eng = TorchEngine.load(served, device, **options)
    ref = ReferenceEngine(
        eng._decoder, eng._lm_head, served.identity, eos_token_id=eng._eos, device=device
    )
    return eng, ref


def check_engine_parity(served, rows: list[torch.Tensor], device: str = "cuda", **options) -> dict:
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import sampling_params

    eng, ref = shipped_engines(served, device, **options)
    eng.warm_up()
    depths = [1, 40, 300, 64, 16, 600, 1000, 2600, 2000]  # 9 lanes: cohorts of 8 and 1
    lanes = [LaneRequest(rows=rows[i % len(rows)], depth=d) for i, d in enumerate(depths)]
    greedy = compare_near_ties(
        ref.readout(lanes), eng.readout(lanes), first_guesses(eng, eng._lm_head, lanes)
    )
    one = lanes[7:8]
    single = compare_near_ties(
        ref.readout(one), eng.readout(one), first_guesses(eng, eng._lm_head, one)
    )
    sampled = [LaneRequest(rows=rows[0], depth=500, sampling=sampling_params(0.8, 3))]
    a, b = ref.readout(sampled)[0], eng.readout(sampled)[0]
    n = min(len(a.token_ids), len(b.token_ids))
    agree = sum(x == y for x, y in zip(a.token_ids[:n], b.token_ids[:n], strict=True)) / max(1, n)
    return {"greedy": greedy, "single_lane": single, "sampled_agreement": agree}


def check_graph_vs_eager(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    from stateblock.engines import LaneRequest
    from stateblock.engines.torch_engine import TorchEngine, TorchEngineOptions
    from stateblock.protocol.sampling import sampling_params

    graphed, _ = shipped_engines(served, device)
    eager = TorchEngine(
        graphed._decoder,
        graphed._lm_head,
        served.identity,
        eos_token_id=graphed._eos,
        options=TorchEngineOptions(device=device, cuda_graphs=False),
    )
    cohorts = [  # several buckets in turn: the shared pool and static buffers are reused
        [LaneRequest(rows=rows[0], depth=200)],
        [LaneRequest(rows=r, depth=d) for r, d in zip(rows[:3], [900, 17, 400], strict=True)],
        [LaneRequest(rows=rows[1], depth=3000, sampling=sampling_params(0.7, 9))],
        [LaneRequest(rows=rows[0], depth=200)],
    ]
    first = None
    for lanes in cohorts:
        a, b = graphed.readout(lanes), eager.readout(lanes)
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.eos_pos == y.eos_pos
            assert (
                max((abs(p - q) for p, q in zip(x.margins, y.margins, strict=True)), default=0)
                < 1e-3
            )
        first = first or a
    assert graphed.readout(cohorts[0]) == first  # a replay after other shapes: same answer
    return {"shapes": [str(s) for s in graphed.recorded_shapes]}


def check_company_invariance(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    """A block's answer read in company is its answer alone, bit for bit (tokens, EOS and
    every margin): at each depth bucket, one greedy lane alone and then placed first, in the
    middle and last among other blocks' lanes of that bucket, up to the most lanes a cohort
    holds (readout_svc.cohorts combines blocks of one engine `cohort_key`)."""
    from stateblock.engines import LaneRequest
    from stateblock.protocol.sampling import K_MAX

    graphed, _ = shipped_engines(served, device)
    shapes = {}
    for depth in (200, 900, 1500, 3000, 8000):
        lane = LaneRequest(rows=rows[0], depth=depth)
        alone = graphed.readout([lane])[0]
        for others in (1, 3, K_MAX - 1):
            company = [
                LaneRequest(rows=rows[1 + i % 3], depth=depth - 1 - i) for i in range(others)
            ]
            key = graphed.cohort_key([lane])
            assert all(graphed.cohort_key([o]) == key for o in company)
            for at in (0, others // 2, others):
                lanes = [*company[:at], lane, *company[at:]]
                got = graphed.readout(lanes)[at]
                assert (got.token_ids, got.eos_pos, got.margins) == (
                    alone.token_ids,
                    alone.eos_pos,
                    alone.margins,
                ), f"depth {depth}: lane {at} of {len(lanes)} differs from alone"
        shapes[depth] = str(graphed._shape([lane])[0])
    return {"shapes": shapes}


def check_beside(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    """`beside()` reads every lane as its engine does, bit for bit, while both run at once
    from two threads: long lanes (a maximal block's parts) on the view, short cohorts on the
    engine, the view's graphs its own and its work on its own stream."""
    import threading

    from stateblock.engines import LaneRequest

    graphed, _ = shipped_engines(served, device)
    other = graphed.beside()
    long = [LaneRequest(rows=rows[i % 3], depth=8000 - i) for i in range(2)]
    short = [[LaneRequest(rows=rows[1 + i % 3], depth=200 - i)] for i in range(24)]
    want_long = graphed.readout(long)
    want_short = [graphed.readout(block) for block in short]
    got_long: list = []
    worker = threading.Thread(target=lambda: got_long.extend(other.readout(long)))
    worker.start()
    got_short = [graphed.readout(block) for block in short]
    worker.join(60)
    assert not worker.is_alive(), "the view's readout never ended"
    assert got_long == want_long, "a long lane read on beside() differs from the engine's"
    assert got_short == want_short, "a short block read beside a long one differs"
    assert other._stream is not None and other._stream != torch.cuda.current_stream()
    assert other._graphs is not graphed._graphs and other._static is not graphed._static
    assert other.recorded, "the view recorded no graph of its own"
    return {"long_shape": str(graphed._shape(long)[0]), "recorded_beside": len(other.recorded)}


def check_logprob_precision(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    """A cohort with a lane asking for log-probabilities runs on exact fp32 dots (its own
    graph) and meets the audit's 1e-3-nat gate; one without runs on the plain path's."""
    from stateblock.engines import LaneRequest, ReferenceEngine
    from stateblock.engines.torch_engine import TorchEngine
    from stateblock.protocol.sampling import sampling_params
    from stateblock.tools.audit import LOGPROB_TOL, logprob_error

    eng = TorchEngine.load(served, device)
    # the exact reference: fp32 throughout (shipped_engines' shares the bf16 resident lm_head,
    # whose rounding alone is 1e-2 nats: that one is for token parity, not for numbers)
    ref = ReferenceEngine(eng._decoder, eng._lm_head.float(), served.identity,
                          eos_token_id=eng._eos, device=device)  # fmt: skip
    lp = sampling_params(logprobs=2)
    depths = [300, 2000, 64, 1000]
    lanes = [
        LaneRequest(rows=rows[i % len(rows)], depth=d, sampling=lp) for i, d in enumerate(depths)
    ]
    plain = [LaneRequest(rows=x.rows, depth=x.depth) for x in lanes]
    err = logprob_error(ref.readout(lanes), eng.readout(lanes))
    compare_near_ties(
        ref.readout(plain), eng.readout(plain), first_guesses(eng, ref._lm_head, plain)
    )
    kinds = {p for _, p in eng.recorded}  # plain lanes: the greedy fast path by default
    assert kinds == {eng._logprob_precision, eng._path(plain)}, eng.recorded
    assert err is not None and err <= LOGPROB_TOL, err
    return {"logprob_max_abs_error": err, "graphs": [f"{s} {p}" for s, p in eng.recorded]}


def check_random_decoder_parity(et) -> dict:
    """At full size (d_base 2688, V 131072; random weights, EOS never wins): the engine vs
    the reference over every position of two lanes, modulo near-ties."""
    from stateblock.engines import LaneRequest, ReferenceEngine

    dec, lm_head, eos = random_weights()
    ident = et.ModelIdentity("bench", b"", b"", b"")
    opts = et.TorchEngineOptions(device="cuda", warm_shapes=())
    eng = et.TorchEngine(dec, lm_head, ident, eos_token_id=eos, options=opts)
    ref = ReferenceEngine(dec, lm_head, ident, eos_token_id=eos, device="cuda")
    g = torch.Generator().manual_seed(5)
    lanes = [
        LaneRequest(rows=torch.randn(p, D_BASE, generator=g).bfloat16(), depth=d)
        for p, d in [(300, 2048), (512, 1500)]
    ]
    stats = compare_near_ties(ref.readout(lanes), eng.readout(lanes))
    assert stats["positions"] == 2048 + 1500, stats
    return stats


def shipped_rows(served) -> list[torch.Tensor]:
    """Captured rows of 9 held-out prompts: one per family, then two with answers of
    ~1,850 and ~2,480 tokens, so the parity check compares thousands of positions."""
    from stateblock.train import tasks

    examples = tasks.per_family(1, split="heldout", seed=7)
    examples += [e for e in tasks.per_family(3, split="heldout", seed=11) if len(e.answer) > 1800]
    return [served.prompt_rows(ex.prompt) for ex in examples]


def check_fused_attention(seed: int = 0) -> dict:
    """The prefix-causal flash kernel vs fp32 SDPA under the dense PrefixCausal mask: "ieee"
    dots within 1e-4, TF32 dots within 2e-2 (10-bit inputs, fp32 accumulation), over
    shapes with ragged query blocks, no prefix, and the decoder's own (8 heads of 32)."""
    import torch.nn.functional as F

    from stateblock.model.kernels.attention import prefix_causal_attention
    from stateblock.model.layers import PrefixCausal

    g = torch.Generator(device="cuda").manual_seed(seed)
    worst = {"ieee": 0.0, "tf32": 0.0}
    for b, h, nq, n_prefix, hd in [(2, 3, 5, 64, 32), (1, 8, 1000, 64, 32), (2, 2, 300, 0, 16),
                                   (1, 2, 129, 7, 64), (1, 8, 8192, 64, 32)]:  # fmt: skip
        q = torch.randn(b, h, nq, hd, generator=g, device="cuda")
        k = torch.randn(b, h, n_prefix + nq, hd, generator=g, device="cuda")
        v = torch.randn(b, h, n_prefix + nq, hd, generator=g, device="cuda")
        mask = PrefixCausal(n_prefix).dense(nq, q.device)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # fp32: no flash
        for precision, tol in (("ieee", 1e-4), ("tf32", 2e-2)):
            out = torch.empty(b, nq, h, hd, device="cuda").transpose(1, 2)
            prefix_causal_attention(q, k, v, n_prefix, out=out, precision=precision)
            err = (out - ref).abs().max().item()
            assert err < tol, (b, h, nq, n_prefix, hd, precision, err)
            worst[precision] = max(worst[precision], err)
    return {"max_abs_err": worst}


def check_fused_attention_rope(seed: int = 0) -> dict:
    """A rotary decoder (`rope`: rotated queries and keys, row keys counted from both ends)
    with the mixer on the flash kernel equals the same decoder on SDPA: exact dots within
    1e-4 on the hidden states, over ragged prompts and a refinement pass."""
    from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
    from stateblock.model.kernels.attention import dot_precision

    torch.manual_seed(seed)
    cfg = ReadoutConfig(d_base=96, vocab_size=64, eos_token_id=2, d_r=256, n_latent=64,
                        n_heads=8, n_mixer=2, mlp_ratio=3, row_attn=True, refine=1, rope=True)  # fmt: skip
    dec = ReadoutDecoder(cfg).cuda().eval()
    lm_head = torch.randn(64, 96, device="cuda")
    rows = torch.randn(3, 50, 96, device="cuda")
    lens = torch.tensor([50, 17, 3], device="cuda")
    positions = torch.arange(700, device="cuda").expand(3, 700)
    guess = dec.guess_embed(lm_head)
    with torch.no_grad(), dot_precision("ieee"):
        ref = dec.hidden(rows, lens, positions, impl="sdpa", guess=guess)
        out = dec.hidden(rows, lens, positions, impl="fused", guess=guess)
    err = (out - ref).abs().max().item()
    assert err < 1e-4, err
    return {"max_abs_err": err}
