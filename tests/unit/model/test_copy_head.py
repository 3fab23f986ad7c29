"""The readout's copy head: the served top-k of the mixture is the dense one, the served answer
is the training mixture's argmax pass by pass, and the head's table travels with the weights."""

import math
from dataclasses import replace

import pytest
import torch

from stateblock.model import checkpoint as ckpt
from stateblock.model.copy_head import CopyHead, log_probs, mixture_topk, space_twins
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.vocab import chunked_topk_lse

D_BASE, VOCAB, EOS = 24, 97, 2


def test_space_twins_map_a_leading_space_to_the_bare_spelling():
    vocab = {"<pad>": 0, "the": 1, "\u0120the": 2, "\u0120cat": 3, "cat\u0120": 4}
    assert space_twins(vocab).tolist() == [-1, -1, 1, -1, -1]
    assert space_twins(vocab, size=7).tolist() == [-1, -1, 1, -1, -1, -1, -1]


def _joint(mode: str, k=3, d=6, p=9, seed=0):
    """One mixture's parts over prompts with repeated tokens and padding."""
    torch.manual_seed(seed)
    head = torch.randn(VOCAB, D_BASE)
    twins = torch.full((VOCAB,), -1, dtype=torch.long)
    twins[10:40] = torch.arange(40, 70)
    ids = torch.randint(5, 30, (k, p))  # a small range: tokens repeat within a prompt
    lens = torch.tensor([p, p - 3, 1])[:k]
    h, rows = torch.randn(k, d, 16), torch.randn(k, p, 16)
    copy = CopyHead(16, D_BASE, mode)
    with torch.no_grad():
        for w in copy.parameters():
            w.normal_(0, 0.5)
    lv = torch.randn(k, d, VOCAB) * 2
    positions = torch.arange(d).expand(k, -1)
    return copy(h, lv, rows, ids, lens, head, positions, twins)


@pytest.mark.parametrize("mode", ["joint", "twin", "gate", "gatetwin"])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_the_served_topk_is_the_dense_mixtures(mode, k):
    parts = _joint(mode)
    lv, cand = parts[1], parts[-1]
    dense = log_probs(parts)  # (K, D, V)
    want_v, want_i = dense.topk(k, dim=-1)
    top_v, top_i = lv.topk(k, dim=-1)
    lse_v = lv.logsumexp(-1)
    if parts[0] == "gate":  # its parts hold the positions' softmax; the served path the scores
        gate, a = parts[2], parts[3].log()
    else:
        gate, a = None, parts[2]
    cand_v = lv.gather(-1, cand[:, None].expand_as(a))
    v, i, lse = mixture_topk(top_v, top_i, lse_v, cand_v, a, cand, k, gate)
    assert torch.equal(i, want_i)
    assert torch.allclose(v - lse[..., None], want_v, atol=1e-5)
    assert len(set(i[0, 0].tolist())) == k  # a token is one candidate, however often it recurs


def make(copy, refine=1, seed=0, row_tokens=False, guess=0, follow=False, span=False, match=0,
         ends=False):  # fmt: skip
    torch.manual_seed(seed)
    cfg = ReadoutConfig(d_base=D_BASE, vocab_size=VOCAB, eos_token_id=EOS, d_r=32, n_latent=4,
                        n_heads=4, row_attn=True, refine=refine, rope=True, copy=copy,
                        row_tokens=row_tokens, copy_guess=guess, copy_follow=follow,
                        copy_span=span, copy_match=match, copy_match_ends=ends)  # fmt: skip
    dec = ReadoutDecoder(cfg).eval()
    with torch.no_grad():
        for w in dec.parameters():
            w.normal_(0, 0.3)
        if copy:
            dec.twins[10:40] = torch.arange(40, 70)
    return dec, torch.randn(VOCAB, D_BASE)


def _lanes(k=3, p=8, d=7):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(k, p, D_BASE, generator=g)
    lens = torch.tensor([p, 5, 2])[:k]
    ids = torch.randint(5, 45, (k, p), generator=g)
    return rows, lens, ids, torch.arange(d).expand(k, -1)


@pytest.mark.parametrize(
    ("mode", "refine", "row_tokens", "guess", "follow"),
    [("twin", 0, False, 0, False), ("twin", 1, False, 0, False), ("gatetwin", 1, False, 0, False),
     ("twin", 1, True, 0, False), ("twin", 1, False, 3, False), ("gate", 0, False, 2, False),
     ("twin", 1, False, 3, True), ("joint", 2, False, 0, True), ("twin", 1, False, 3, "span"),
     ("gatetwin", 2, False, 2, "span"), ("twin", 0, False, 3, "match"),
     ("gate", 1, False, 0, "match"), ("twin", 1, False, 3, "ends")],
)  # fmt: skip
def test_the_served_answer_is_the_training_mixtures_argmax(mode, refine, row_tokens, guess, follow):
    span, match, ends = follow == "span", 4 if follow in ("match", "ends") else 0, follow == "ends"
    dec, head = make(mode, refine, row_tokens=row_tokens, guess=guess, follow=follow is True,
                     span=span, match=match, ends=ends)  # fmt: skip
    if span:
        with torch.no_grad():
            dec.copy_head.w_span.fill_(30.0)  # the vote decides: it must reach both paths
    if match:
        with torch.no_grad():  # the runs decide: they must reach both paths
            w = dec.copy_head.w_match
            w.copy_(torch.arange(float(w.numel())).view_as(w) * 6)
    rows, lens, ids, pos = _lanes()
    depth = torch.full((3,), pos.shape[1])
    with torch.no_grad():
        parts = dec.pass_parts(rows, lens, pos, head, ids)
        out = dec(rows, lens, pos, depth, head, prompt_ids=ids)
    assert len(parts) == 1 + refine
    lp = log_probs(parts[-1])
    assert torch.equal(out.tokens, lp.argmax(-1))
    assert torch.allclose(out.top1_logprob, lp.max(-1).values, atol=1e-4)
    copied = torch.isin(out.tokens, torch.cat([ids, dec.twins[ids]], -1))
    assert copied.any()  # the weights are random: some answer token is a copy's, not all
    shallow = dec(rows, lens, pos[:, :4], torch.full((3,), 4), head, prompt_ids=ids)
    assert torch.equal(shallow.tokens, out.tokens[:, :4])  # prefix-causal with the copy head


def test_the_copy_head_needs_the_prompt_ids():
    dec, head = make("twin")
    rows, lens, ids, pos = _lanes()
    depth = torch.full((3,), pos.shape[1])
    with pytest.raises(ValueError, match="token ids"):
        dec(rows, lens, pos, depth, head)
    with pytest.raises(ValueError, match="token ids"):
        dec.pass_parts(rows, lens, pos, head)
    with pytest.raises(ValueError, match="token ids"):  # the paths that take rows alone
        dec.pass_logits(rows, lens, pos, head)
    with pytest.raises(ValueError, match="copy='pointer'"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy="pointer")


def test_without_a_copy_head_the_parts_are_the_logits():
    dec, head = make("")
    rows, lens, ids, pos = _lanes()
    with torch.no_grad():
        parts = dec.pass_parts(rows, lens, pos, head, ids)
        logits = dec.pass_logits(rows, lens, pos, head)
    assert [p[0] for p in parts] == ["base", "base"]
    assert all(torch.equal(p[1], lg) for p, lg in zip(parts, logits, strict=True))
    assert not hasattr(dec, "twins") and "copy_head.q.weight" not in dec.state_dict()


def test_the_twins_table_is_saved_and_digested_with_the_weights(tmp_path):
    dec, head = make("twin")
    ckpt.save_decoder(tmp_path, dec, {"base_model_digest": "b"}, {})
    manifest = ckpt.read_manifest(tmp_path)
    back = ckpt.build_decoder(tmp_path, manifest)
    assert back.cfg.copy == "twin" and torch.equal(back.twins, dec.twins)
    assert back.twins.dtype == torch.long and int(dec.twins.max()) == 69
    dec.twins[50] = 3
    ckpt.save_decoder(tmp_path / "other", dec, {"base_model_digest": "b"}, {})
    assert ckpt.read_manifest(tmp_path / "other")["decoder_digest"] != manifest["decoder_digest"]


def test_a_config_saved_before_the_copy_head_loads_without_one():
    d = ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1).to_dict()
    del d["copy"]
    assert ReadoutConfig.from_dict(d).copy == ""


def test_chunked_lse_is_the_vocabularys_for_the_mixture():
    """mixture_topk folds the vocabulary's chunked lse: the served decoder's inputs agree."""
    h, head = torch.randn(2, 5, D_BASE), torch.randn(VOCAB, D_BASE)
    _, _, lse = chunked_topk_lse(h, head, 4, 2)
    assert torch.allclose(lse, (h @ head.t()).logsumexp(-1), atol=1e-4)


def test_the_loss_of_bf16_parts_is_computed_in_fp32():
    """Under the trainer's bf16 autocast the mixture's parts are bf16; its loss is not."""
    from stateblock.train.readout_ddp import parts_loss

    _, lv, a, cand = _joint("twin")
    tgt = torch.randint(5, 60, lv.shape[:2])
    half = ("joint", lv.bfloat16(), a.bfloat16(), cand)
    want = parts_loss(("joint", lv.bfloat16().float(), a.bfloat16().float(), cand), tgt, EOS)
    got = parts_loss(half, tgt, EOS)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    assert log_probs(half).dtype == torch.float32


def test_row_tokens_read_the_prompt_ids_and_serve_the_training_argmax():
    """`row_tokens` without a copy head: the rows carry their tokens (so the answer depends
    on them), the served tokens are the training logits' argmax, and the ids are required."""
    dec, head = make("", refine=1, row_tokens=True)
    rows, lens, ids, pos = _lanes()
    depth = torch.full((3,), pos.shape[1])
    with torch.no_grad():
        parts = dec.pass_parts(rows, lens, pos, head, ids)
        out = dec(rows, lens, pos, depth, head, prompt_ids=ids)
        other = dec(rows, lens, pos, depth, head, prompt_ids=(ids + 7) % VOCAB)
    assert [p[0] for p in parts] == ["base", "base"]
    assert torch.equal(out.tokens, parts[-1][1].argmax(-1))
    assert not torch.equal(out.tokens, other.tokens)
    with pytest.raises(ValueError, match="token ids"):
        dec(rows, lens, pos, depth, head)


def test_the_base_guess_candidates_are_the_last_rows_top_tokens():
    dec, head = make("twin", guess=3)
    rows, lens, ids, pos = _lanes()
    c = dec.context(rows, lens, prompt_ids=ids, lm_head=head)
    gids, glp, last = c.guess
    base = (rows[torch.arange(3), lens - 1] @ head.t()).log_softmax(-1)  # (K, V)
    assert torch.equal(gids[:, 0], base.argmax(-1))  # the teacher's greedy first token
    assert torch.allclose(glp, base.gather(-1, gids), atol=1e-5)
    assert torch.equal(last, c.rows[torch.arange(3), lens - 1])
    with torch.no_grad():
        parts = dec.pass_parts(rows, lens, pos, head, ids)
    cand = parts[-1][-1]
    assert cand.shape[1] == 2 * ids.shape[1] + 3 and torch.equal(cand[:, -3:], gids)
    # the base's log-probability enters each guess's score: a large weight ranks them as the
    # base does
    h = torch.randn(3, pos.shape[1], 32)
    with torch.no_grad():
        dec.copy_head.g_lp.fill_(1e4)
        g = dec.copy_head.guess_scores(h, head, pos, gids, glp, last)  # (K, D, G)
    assert torch.equal(g.argsort(-1, descending=True), torch.arange(3).expand(3, pos.shape[1], 3))


def test_copy_guess_needs_a_copy_head():
    with pytest.raises(ValueError, match="copy_guess=2 needs a copy head"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy_guess=2)
    with pytest.raises(ValueError, match="copy_guess=-1"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy="twin", copy_guess=-1)


def test_follow_rewards_the_position_after_the_previous_passs_tokens():
    dec, _ = make("twin", follow=True)
    w0, w1 = dec.copy_head.w_follow.tolist()
    ids = torch.tensor([[7, 8, 9, 7, 8, 5]])  # (1, P)
    prev = torch.tensor([[7, 8, 42]])  # the previous pass's tokens (1, D)
    twins = torch.full((VOCAB,), -1, dtype=torch.long)
    twins[9] = 42  # 42 is 9 spelled without its leading space
    with torch.no_grad():
        b = dec.copy_head.follow_bonus(ids, twins, prev)[0]  # (D, P)
    # t=0 reads nothing before it; t=1 follows a 7 (positions 1 and 4); t=2 follows a 7 8
    # (positions 2 and 5, both tokens matching) and nothing follows a 42 at t=3
    assert b[0].tolist() == [0.0] * 6
    assert b[1].tolist() == pytest.approx([0, w0, 0, 0, w0, 0])
    assert b[2].tolist() == pytest.approx([0, 0, w0 + w1, 0, 0, w0 + w1])
    b2 = dec.copy_head.follow_bonus(ids, twins, torch.tensor([[0, 42, 1]]))[0]
    assert b2[2].tolist() == pytest.approx([0, 0, 0, w0, 0, 0])  # 42 matches 9 by its twin
    with pytest.raises(ValueError, match="copy_follow and copy_span need"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy="twin", copy_follow=True)


def test_the_span_vote_is_the_mean_diagonal_of_the_previous_pass():
    from stateblock.model.copy_head import span_vote

    pos = torch.zeros(1, 3, 6)  # (K, D, P): a pass copying the span starting at position 2
    pos[0, 0, 2], pos[0, 1, 3], pos[0, 2, 1] = 1.0, 1.0, 1.0  # ... but t=2 strays to 1
    v = span_vote(pos)[0]  # (D, P)
    assert v[0].tolist() == [0, 0, 1, 0, 0, 0]  # t=0: start 2 at position 2
    assert v[1].tolist() == [0, 0, 0, 1, 0, 0]  # t=1: both voted start 2 -> position 3
    # t=2: starts 2 (two votes) and -1 (past the prompt's start, dropped): position 4
    assert v[2].tolist() == pytest.approx([0, 0, 0, 0, 2 / 3, 0])
    with pytest.raises(ValueError, match="copy_span need"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy="twin", copy_span=True)


def test_repeat_runs_count_the_tokens_before_a_position_that_recur_together():
    from stateblock.model.copy_head import repeat_runs

    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 8]] * 3)
    runs = repeat_runs(ids, torch.tensor([8, 8, 6]), most=16)
    assert runs[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert runs[2].tolist() == [0, 1, 2, 0, 0, 1, 2, 0]  # past lens: no token recurs
    assert repeat_runs(ids, torch.tensor([8, 8, 8]), most=2)[0].tolist() == [0, 1, 2, 2, 0, 1, 2, 2]


def test_the_match_bonus_reads_the_runs_before_each_answer_positions_span_start():
    """At answer position t, prompt position p gains w[0][run before p - t] + w[1][run
    before p - t - 1], nothing where p - t is before the prompt."""
    from stateblock.model.copy_head import repeat_runs

    dec, _ = make("twin", match=3)
    w = torch.arange(8.0).view(2, 4)
    with torch.no_grad():
        dec.copy_head.w_match.copy_(w)
    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 8]])
    lens, pos = torch.tensor([8]), torch.arange(4).view(1, -1)
    got = dec.copy_head.match_bonus(repeat_runs(ids, lens, 3), pos)[0]  # (D, P)
    runs = repeat_runs(ids, lens, 3)[0].tolist()
    for t in range(4):
        for p in range(8):
            s = p - t
            want = 0.0 if s < 0 else w[0, runs[s]] + (w[1, runs[s - 1]] if s > 0 else w[1, 0])
            assert got[t, p] == want, (t, p)
    with pytest.raises(ValueError, match="copy_match=2 needs a copy head"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy_match=2)


def test_run_ends_mark_where_a_repeated_run_stops():
    from stateblock.model.copy_head import repeat_runs, run_ends

    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 8]])
    runs = repeat_runs(ids, torch.tensor([8]), most=16)  # [0, 1, 2, 3, 0, 1, 2, 3]
    assert run_ends(runs, 16)[0].tolist() == [False, False, False, True, False, False, False, True]
    runs = repeat_runs(ids, torch.tensor([8]), most=2)  # saturated: [0, 1, 2, 2, 0, 1, 2, 2]
    assert run_ends(runs, 2)[0].tolist() == [False, False, False, True, False, False, False, True]


def test_with_match_ends_a_saturated_quote_scores_its_end_alone():
    """A quote longer than `match` has the longest run over its last stretch; the runs that
    stop there, at its end, index bonuses of their own."""
    from stateblock.model.copy_head import repeat_runs

    quote = list(range(10, 16))  # six tokens, runs saturate at 3
    ids = torch.tensor([[*quote, 20, 21, 22, 30, 31, *quote, 40]])
    lens, pos = torch.tensor([ids.shape[1]]), torch.zeros(1, 1, dtype=torch.long)
    dec, _ = make("twin", match=3)
    cfg = replace(dec.cfg, copy_match_ends=True)
    ends = ReadoutDecoder(cfg).copy_head
    assert ends.w_match.shape == (2, 8)
    with torch.no_grad():
        ends.w_match.zero_()
        ends.w_match[0, 4 + 3] = 5.0  # a run of 3 that stops here
    got = ends.match_bonus(repeat_runs(ids, lens, 3), pos)[0, 0]  # (P,) at t = 0
    assert got.nonzero().flatten().tolist() == [6, 17]  # after each copy of the quote
    with pytest.raises(ValueError, match="copy_match_ends needs copy_match"):
        ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, copy="twin", copy_match_ends=True)


def test_the_point_bonus_reads_the_bases_attention_at_each_span_start():
    """At answer position t, position p gains s0 log M0(p - t) + s1 log M1(p - t - 1), M_i the
    maps mixed by softmax(w_point[i]), and nothing where p - t is before the prompt."""
    head = CopyHead(16, 8, "joint", point=2)
    with torch.no_grad():
        head.w_point.copy_(torch.tensor([[0.0, math.log(3.0)], [5.0, -5.0]]))
        head.w_point_scale.copy_(torch.tensor([1.0, 0.5]))
    point = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]])  # (K=1, A=2, P=4)
    pos = torch.arange(3).view(1, 3)
    got = head.point_bonus(point, pos)[0]  # (D, P)
    m0 = 0.25 * point[0, 0] + 0.75 * point[0, 1]
    w1 = torch.tensor([5.0, -5.0]).softmax(-1)
    m1 = w1[0] * point[0, 0] + w1[1] * point[0, 1]
    before = torch.cat([torch.tensor([math.log(1e-6)]), m1.log()[:-1]])
    per = m0.log() + 0.5 * before  # (P,)
    for t in range(3):
        for p in range(4):
            want = per[p - t] if p >= t else 0.0
            assert got[t, p].item() == pytest.approx(float(want), abs=1e-5)
    fresh = CopyHead(16, 8, "joint", point=2).point_bonus(point, pos)
    assert (fresh == 0).all()  # from zero: the head starts as it would without the maps


def test_a_pointing_decoder_needs_its_attention_maps():
    cfg = ReadoutConfig(d_base=8, vocab_size=VOCAB, eos_token_id=2, d_r=16, n_heads=2, n_latent=4,
                        copy="joint", copy_point=3)  # fmt: skip
    dec = ReadoutDecoder(cfg)
    rows, ids = torch.randn(1, 5, 8), torch.randint(3, VOCAB, (1, 5))
    lens, pos, head = torch.tensor([5]), torch.arange(4).view(1, 4), torch.randn(VOCAB, 8)
    with pytest.raises(ValueError, match="3 of the base's attention maps"):
        dec.pass_parts(rows, lens, pos, head, ids)
    with pytest.raises(ValueError, match="attention maps"):
        dec.pass_parts(rows, lens, pos, head, ids, torch.rand(1, 2, 5))
    parts = dec.pass_parts(rows, lens, pos, head, ids, torch.rand(1, 3, 5).softmax(-1))
    assert parts[-1][2].shape == (1, 4, 5)
    with pytest.raises(ValueError, match="copy_point"):
        ReadoutConfig(d_base=8, vocab_size=VOCAB, eos_token_id=2, copy_point=2)
