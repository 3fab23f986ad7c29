"""The readout decoder's graph: attention parity, chunked top-2, EOS scan, sampling, lanes."""

import pytest
import torch

from stateblock.model.decoder import NO_EOS, ReadoutConfig, ReadoutDecoder
from stateblock.model.vocab import chunked_topk, first_eos, gumbel_noise, gumbel_select

D_BASE, VOCAB, EOS = 48, 203, 7  # vocab not divisible by the chunk count on purpose


def make(seed: int = 0, **kw) -> tuple[ReadoutDecoder, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = ReadoutConfig(
        d_base=D_BASE, vocab_size=VOCAB, eos_token_id=EOS, d_r=64, n_latent=8, n_heads=4, **kw
    )
    dec = ReadoutDecoder(cfg).eval()
    with torch.no_grad():  # larger weights than init so outputs vary by position and lane
        for p in dec.parameters():
            p.normal_(0, 0.3)
    return dec, torch.randn(VOCAB, D_BASE)


def lanes(k: int, p: int, d: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, p, D_BASE, generator=g)
    lens = torch.randint(1, p + 1, (k,), generator=g)
    pos = torch.arange(d).expand(k, -1)
    return rows, lens, pos


def test_explicit_and_sdpa_attention_agree():
    dec, _ = make(n_mixer=2)
    rows, lens, pos = lanes(3, 11, 40)
    with torch.no_grad():
        a = dec.hidden(rows, lens, pos, impl="explicit")
        b = dec.hidden(rows, lens, pos, impl="sdpa")
    diff = (a - b).abs().max().item()
    print(f"explicit vs sdpa max abs diff {diff:.2e} (scale {a.abs().max().item():.2f})")
    assert diff < 1e-4 * max(1.0, a.abs().max().item())


def test_chunked_top2_equals_full_topk():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 33, D_BASE, generator=g)
    w = torch.randn(VOCAB, D_BASE, generator=g)
    for n_chunks in (1, 3, 8):
        v, i = chunked_topk(h, w, n_chunks, 2)
        fv, fi = torch.topk(h @ w.t(), 2, dim=-1)
        assert torch.equal(i, fi), n_chunks
        assert torch.allclose(v, fv, atol=1e-5)


def test_chunked_projection_never_builds_full_logits(monkeypatch):
    widths = []
    real = torch.matmul

    def spy(a, b):
        out = real(a, b)
        widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(torch, "matmul", spy)
    chunked_topk(torch.randn(2, 5, D_BASE), torch.randn(VOCAB, D_BASE), 8, 2)
    assert max(widths) == -(-VOCAB // 8) < VOCAB


def test_first_eos_position_and_sentinel():
    toks = torch.tensor([[1, 2, EOS, 3, EOS], [1, 1, 1, 1, 1], [EOS, 1, 1, 1, 1]])
    valid = torch.tensor([[True] * 5, [True] * 5, [False] + [True] * 4])
    assert first_eos(toks, valid, EOS).tolist() == [2, NO_EOS, NO_EOS]
    assert NO_EOS == 1 << 20


def test_temperature_zero_is_exact_argmax():
    dec, w = make()
    rows, lens, pos = lanes(3, 9, 64)
    depths = torch.full((3,), 64)
    with torch.no_grad():
        greedy = dec(rows, lens, pos, depths, w)
        noise = gumbel_noise((3, 64, 8), seed=5) * 100.0  # large noise must have no effect
        t0 = dec(rows, lens, pos, depths, w, temperature=torch.zeros(3), noise=noise)
    assert torch.equal(t0.tokens, greedy.top1)
    assert torch.equal(t0.eos_pos, greedy.eos_pos)


def test_sampling_is_reproducible_with_fixed_noise_and_actually_samples():
    dec, w = make()
    rows, lens, pos = lanes(2, 9, 128)
    depths = torch.full((2,), 128)
    temp = torch.full((2,), 5.0)
    with torch.no_grad():
        a = dec(rows, lens, pos, depths, w, temperature=temp, noise=gumbel_noise((2, 128, 8), 11))
        b = dec(rows, lens, pos, depths, w, temperature=temp, noise=gumbel_noise((2, 128, 8), 11))
        c = dec(rows, lens, pos, depths, w, temperature=temp, noise=gumbel_noise((2, 128, 8), 12))
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)  # a different seed samples differently
    assert not torch.equal(a.tokens, a.top1)  # high temperature leaves the argmax
    # every sampled id is one of the top-8 candidates
    v, i = chunked_topk(dec.hidden(rows, lens, pos), w, 8, 8)
    assert bool((i == a.tokens.unsqueeze(-1)).any(-1).all())


def test_gumbel_select_picks_max_of_perturbed_scores():
    top_v = torch.tensor([[[3.0, 2.0, 1.0]]])
    top_i = torch.tensor([[[10, 20, 30]]])
    noise = torch.tensor([[[0.0, 0.0, 5.0]]])
    assert gumbel_select(top_v, top_i, torch.tensor([1.0]), noise).item() == 30
    assert gumbel_select(top_v, top_i, torch.tensor([0.0]), noise).item() == 10


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_packed_lanes_equal_each_lane_alone(impl):
    dec, w = make(n_mixer=2)
    g = torch.Generator().manual_seed(9)
    plens, depths = [3, 17, 8], [50, 12, 33]
    rows = [torch.randn(p, D_BASE, generator=g) for p in plens]
    padded = torch.zeros(3, max(plens), D_BASE)
    for k, r in enumerate(rows):
        padded[k, : len(r)] = r
    pos = torch.arange(max(depths)).expand(3, -1)
    with torch.no_grad():
        packed = dec(padded, torch.tensor(plens), pos, torch.tensor(depths), w, impl=impl)
        for k, (r, d) in enumerate(zip(rows, depths, strict=True)):
            alone = dec(
                r[None],
                torch.tensor([len(r)]),
                torch.arange(d)[None],
                torch.tensor([d]),
                w,
                impl=impl,
            )
            assert torch.equal(packed.top1[k, :d], alone.top1[0])
            assert torch.allclose(packed.margin[k, :d], alone.margin[0], atol=1e-4)
            assert packed.eos_pos[k].item() == alone.eos_pos[0].item()


def test_reading_deeper_never_changes_earlier_positions():
    dec, w = make(n_mixer=2)
    rows, lens, _ = lanes(2, 7, 1)
    with torch.no_grad():
        short = dec(rows, lens, torch.arange(40).expand(2, -1), torch.full((2,), 40), w)
        deep = dec(rows, lens, torch.arange(300).expand(2, -1), torch.full((2,), 300), w)
    assert torch.equal(short.top1, deep.top1[:, :40])


def test_eos_scan_finds_the_first_emitted_eos():
    dec, w = make()
    rows, lens, pos = lanes(4, 6, 200)
    w = w.clone()
    w[EOS] *= 0.0  # make EOS appear somewhere by giving it a constant zero logit
    w[EOS] += dec.hidden(rows, lens, pos).mean((0, 1)) * 3
    with torch.no_grad():
        out = dec(rows, lens, pos, torch.full((4,), 200), w)
    for k in range(4):
        hits = (out.tokens[k] == EOS).nonzero().flatten().tolist()
        assert out.eos_pos[k].item() == (hits[0] if hits else NO_EOS)


def test_positions_are_functional_not_a_table():
    dec, w = make()
    assert not any(
        "pos" in n and p.dim() == 2 and p.shape[0] > 1000 for n, p in dec.named_parameters()
    )
    rows, lens, _ = lanes(1, 4, 1)
    with torch.no_grad():  # deeper than any profile: no ceiling comes from the parameters
        out = dec(rows, lens, torch.tensor([[0, 9000, 20000]]), torch.tensor([20001]), w)
    assert out.tokens.shape == (1, 3)


def test_ignore_eos_returns_every_position_eos_included():
    """The shipped decoder stops `copy: hello` at its EOS; with ignore_eos the same lane
    returns all `depth` tokens: the answer, then the EOS token, then what follows."""
    from stateblock.engines import LaneRequest, create_engine, lane_result
    from stateblock.model.loading import load_serving_model
    from stateblock.model.vocab import NO_EOS
    from stateblock.protocol.sampling import sampling_params
    from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER

    model = load_serving_model(DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER)
    rows = model.prompt_rows("copy: hello")
    engine = create_engine("reference", model)
    plain, ignoring = engine.readout(
        [
            LaneRequest(rows=rows, depth=24),
            LaneRequest(rows=rows, depth=24, sampling=sampling_params(ignore_eos=True)),
        ]
    )
    eos = plain.eos_pos
    assert eos < 24, "the shipped decoder should end this answer with EOS"
    assert len(ignoring.token_ids) == 24 and ignoring.eos_pos == NO_EOS
    assert ignoring.token_ids[:eos] == plain.token_ids
    assert ignoring.token_ids[eos] == model.tokenizer.eos_token_id
    assert len(ignoring.margins) == 24 and ignoring.margins[: eos + 1] == plain.margins
    # the cut itself, on made-up reads: EOS at 2 of depth 4
    lane = LaneRequest(rows=rows, depth=4)
    assert lane_result(lane, [7, 8, 2, 9, 9], [1.0] * 5, 2).token_ids == (7, 8)
    assert lane_result(lane, [7, 8, 2, 9, 9], [1.0] * 5, NO_EOS).token_ids == (7, 8, 2, 9)


# -- the fidelity options: rows attended by every answer position, in-graph refinement ----
OPTIONS = [
    pytest.param({"row_attn": True}, id="row_attn"),
    pytest.param({"refine": 1}, id="refine"),
    pytest.param({"row_attn": True, "refine": 2}, id="row_attn+refine2"),
    pytest.param({"row_attn": True, "refine": 1, "rope": True}, id="row_attn+refine+rope"),
]


@pytest.mark.parametrize("opts", OPTIONS)
def test_options_keep_explicit_sdpa_parity_and_prefix_causality(opts):
    dec, w = make(n_mixer=2, **opts)
    rows, lens, _ = lanes(3, 11, 1)
    with torch.no_grad():
        deep = dec(rows, lens, torch.arange(90).expand(3, -1), torch.full((3,), 90), w)
        expl = dec(rows, lens, torch.arange(90).expand(3, -1), torch.full((3,), 90), w,
                   impl="explicit")  # fmt: skip
        short = dec(rows, lens, torch.arange(25).expand(3, -1), torch.full((3,), 25), w)
    assert torch.equal(deep.top1, expl.top1)
    assert torch.allclose(deep.margin, expl.margin, atol=1e-4)
    assert torch.equal(short.top1, deep.top1[:, :25])  # truncation stays exact


@pytest.mark.parametrize("opts", OPTIONS)
def test_options_ignore_padding_rows_and_other_lanes(opts):
    dec, w = make(n_mixer=2, **opts)
    g = torch.Generator().manual_seed(4)
    plens, depths = [3, 17, 8], [50, 12, 33]
    rows = [torch.randn(p, D_BASE, generator=g) for p in plens]
    padded = torch.full((3, max(plens), D_BASE), 50.0)  # garbage in every padding row
    for k, r in enumerate(rows):
        padded[k, : len(r)] = r
    pos = torch.arange(max(depths)).expand(3, -1)
    with torch.no_grad():
        packed = dec(padded, torch.tensor(plens), pos, torch.tensor(depths), w)
        for k, (r, d) in enumerate(zip(rows, depths, strict=True)):
            alone = dec(r[None], torch.tensor([len(r)]), torch.arange(d)[None],
                        torch.tensor([d]), w)  # fmt: skip
            assert torch.equal(packed.top1[k, :d], alone.top1[0])


def test_row_attention_counts_rows_from_the_prompt_end():
    """With row_attn the rows carry their distance from the prompt's end: the same rows
    under a longer prompt_len read differently (a reversal needs that offset)."""
    dec, w = make(n_mixer=1, row_attn=True)
    rows, _, pos = lanes(1, 9, 30)
    with torch.no_grad():
        a = dec.context(rows, torch.tensor([6])).rows[0, :6]
        b = dec.context(rows, torch.tensor([9])).rows[0, :6]
    assert not torch.allclose(a, b)
    plain, _ = make(n_mixer=1)
    with torch.no_grad():
        c = plain.context(rows, torch.tensor([6])).rows[0, :6]
        d = plain.context(rows, torch.tensor([9])).rows[0, :6]
    assert torch.equal(c, d)


def test_refinement_reads_the_first_guess_and_training_sees_every_pass():
    dec, w = make(n_mixer=1, refine=1)
    rows, lens, pos = lanes(2, 7, 40)
    with torch.no_grad():
        out = dec(rows, lens, pos, torch.full((2,), 40), w)
        per_pass = dec.pass_logits(rows, lens, pos, w)
        first = dec.passes(rows, lens, pos, guess=dec.guess_embed(w))[0]
        # a different first guess changes the answer: the refinement really reads it
        other = dec.passes(rows, lens, pos, guess=lambda h: torch.zeros_like(h))[-1]
    assert len(per_pass) == 2
    assert torch.equal(per_pass[-1].argmax(-1), out.top1)  # training's last pass = served
    assert torch.equal(per_pass[0].argmax(-1), (dec.out(first) @ w.t()).argmax(-1))
    assert not torch.equal((dec.out(other) @ w.t()).argmax(-1), out.top1)
    with pytest.raises(ValueError, match="guess"):
        dec.passes(rows, lens, pos)


def test_old_checkpoint_configs_load_without_the_options():
    cfg = ReadoutConfig.from_dict(
        {"d_base": 8, "vocab_size": 10, "eos_token_id": 2, "d_r": 8, "n_heads": 2}
    )
    assert not cfg.row_attn and cfg.refine == 0
    assert ReadoutConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="refine"):
        ReadoutConfig(d_base=8, vocab_size=10, eos_token_id=2, d_r=8, n_heads=2, refine=-1)


def test_log_sum_exp_folded_per_chunk_is_exact():
    from stateblock.model.vocab import chunked_topk_lse

    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 17, D_BASE, generator=g) * 3
    w = torch.randn(VOCAB, D_BASE, generator=g)
    full = h @ w.t()
    for n_chunks in (1, 3, 8):
        v, i, lse = chunked_topk_lse(h, w, n_chunks, 2)
        assert torch.allclose(lse, torch.logsumexp(full, -1), atol=1e-4)
        assert torch.equal(i, torch.topk(full, 2, -1).indices)


def test_readout_log_probabilities_are_the_full_softmax_ones():
    dec, w = make(n_mixer=2, refine=1)
    rows, lens, pos = lanes(3, 9, 50)
    depths = torch.full((3,), 50)
    noise = gumbel_noise((3, 50, 8), seed=2)
    with torch.no_grad():
        full = torch.log_softmax(dec.logits(rows, lens, pos, w), -1)  # (K, D, V)
        out = dec(
            rows, lens, pos, depths, w, temperature=torch.tensor([0.0, 1.0, 2.0]), noise=noise
        )
    at = lambda ids: full.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # noqa: E731
    assert torch.allclose(out.top1_logprob, at(out.top1), atol=1e-4)
    assert torch.allclose(out.token_logprob, at(out.tokens), atol=1e-4)
    assert torch.allclose(out.top1_logprob - out.margin, at(out.top2), atol=1e-4)
    assert not torch.equal(out.tokens[2], out.top1[2])  # the hot lane sampled: a real check


def test_rope_makes_row_attention_relative():
    """With rope a row-attention head's score depends on (answer position - row position)
    (or from the prompt's end): shifting both by the same amount leaves it unchanged."""
    from stateblock.model.decoder import rope_tables, rotate

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=g)
    k = torch.randn(1, 1, 1, 16, generator=g)

    def score(tq: int, tk: int) -> float:
        qc, qs = rope_tables(torch.tensor([tq]), 16, 10000.0)
        kc, ks = rope_tables(torch.tensor([tk]), 16, 10000.0)
        return float((rotate(q, qc, qs) * rotate(k, kc, ks)).sum())

    assert score(3, 10) == pytest.approx(score(103, 110), abs=1e-4)
    assert score(3, 10) != pytest.approx(score(3, 11), abs=1e-4)
    with pytest.raises(ValueError, match="rope"):
        ReadoutConfig(d_base=8, vocab_size=10, eos_token_id=2, d_r=6, n_heads=2, rope=True)


def test_a_subword_vocabulary_of_16384_reads_as_its_full_logits():
    """The prose base's vocabulary (issue 41): the chunked top-2 and the sampling's top-8
    over 16,384 lm_head rows are the full logits' top-k, EOS and log-probabilities included."""
    from stateblock.model.vocab import chunked_topk_lse

    vocab, eos = 16_384, 2
    torch.manual_seed(0)
    cfg = ReadoutConfig(d_base=D_BASE, vocab_size=vocab, eos_token_id=eos, d_r=32, n_latent=4,
                        n_heads=4, row_attn=True, rope=True)  # fmt: skip
    dec = ReadoutDecoder(cfg).eval()
    w = torch.randn(vocab, D_BASE)
    rows, lens, pos = lanes(3, 9, 40)
    with torch.no_grad():
        w[eos] = dec.hidden(rows, lens, pos)[0, 5] * 100  # EOS wins at lane 0's position 5
        full = dec.logits(rows, lens, pos, w)  # (K, D, V)
        out = dec(rows, lens, pos, torch.full((3,), 40), w)
        v8, i8, _ = chunked_topk_lse(dec.hidden(rows, lens, pos), w, cfg.n_chunks, 8)
    top = torch.topk(full, 8, dim=-1)
    assert torch.equal(out.top1, top.indices[..., 0]) and torch.equal(out.top2, top.indices[..., 1])
    assert torch.equal(i8, top.indices) and torch.allclose(v8, top.values, atol=1e-4)
    lp = torch.log_softmax(full, -1).max(-1).values
    assert torch.allclose(out.top1_logprob, lp, atol=1e-4)
    hits = out.top1 == eos
    assert bool(hits.any())
    first = torch.where(hits, torch.arange(40), NO_EOS).min(-1).values
    assert torch.equal(out.eos_pos, first)
