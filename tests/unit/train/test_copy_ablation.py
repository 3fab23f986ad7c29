"""The copy head's training side: each mixture a distribution whose training loss
(`parts_loss`) is the one its full log-probabilities give, and an ablation arm that trains and
evaluates end to end on a small copy task."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from stateblock.model.copy_head import CopyHead, log_probs
from stateblock.train import copy_ablation as ca
from stateblock.train.readout_ddp import parts_loss

V, D_BASE, EOS = 40, 16, 2


def _parts(mode: str, k=3, d=5, p=7, bias=0.0, vocab_logits=None) -> tuple:
    torch.manual_seed(0)
    head = torch.randn(V, D_BASE)
    twins = torch.full((V,), -1, dtype=torch.long)
    twins[10:20] = torch.arange(20, 30)
    copy = CopyHead(32, D_BASE, mode, bias=bias)
    ids = torch.randint(3, V, (k, p))
    lens = torch.tensor([p, p - 2, 3])
    positions = torch.arange(d).expand(k, -1)
    h, rows = torch.randn(k, d, 32), torch.randn(k, p, 32)
    lv = torch.randn(k, d, V) if vocab_logits is None else vocab_logits
    return copy(h, lv, rows, ids, lens, head, positions, twins), ids, lens


@pytest.mark.parametrize("mode", ["gate", "joint", "twin", "gatetwin"])
def test_each_mixture_is_a_distribution_and_its_loss_is_the_gathered_one(mode):
    parts, ids, lens = _parts(mode)
    lp = log_probs(parts)  # (K, D, V)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(lp.shape[:2]), atol=1e-5)
    tgt = torch.randint(3, V, (3, 5))
    tgt[0, :2] = ids[0, :2]  # targets the prompt holds: the copy's share counts
    tgt[1, 4], tgt[2, 3:] = EOS, -100
    want = torch.nn.functional.nll_loss(lp.flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                        reduction="none")  # fmt: skip
    w = torch.where(tgt.flatten() == EOS, 10.0, 1.0) * (tgt.flatten() != -100)
    assert torch.allclose(parts_loss(parts, tgt, EOS, 10.0), (want * w).sum() / w.sum(), atol=1e-4)


@pytest.mark.parametrize("mode", ["joint", "twin"])
def test_a_low_copy_bias_leaves_the_vocabulary_distribution(mode):
    lv = torch.randn(3, 5, V)
    parts, _, _ = _parts(mode, bias=-60.0, vocab_logits=lv)
    assert torch.allclose(log_probs(parts), lv.log_softmax(-1), atol=1e-4)
    parts, _, _ = _parts(mode, bias=0.0, vocab_logits=lv)
    assert not torch.allclose(log_probs(parts), lv.log_softmax(-1), atol=1e-2)


def test_padding_positions_get_no_copy_mass():
    parts, ids, lens = _parts("joint")
    a = parts[2]
    assert torch.isinf(a[2, :, 3:]).all() and torch.isfinite(a[2, :, :3]).all()


def test_an_arm_trains_and_evaluates_on_a_copy_task():
    """Answers that repeat a span of their prompt: every arm runs its passes, and the held-out
    evaluation counts every record by family."""
    rng = random.Random(0)

    def record(family: str) -> dict:
        prompt = [rng.randrange(3, V) for _ in range(rng.randint(6, 10))]
        return {"family": family, "prompt_ids": prompt, "answer_ids": prompt[1:4] + [EOS]}

    recs = [record(f) for f in ("repeat", "question") * 8]
    rows = [torch.randn(len(r["prompt_ids"]), D_BASE).half() for r in recs]
    maps = [torch.rand(3, len(r["prompt_ids"])).softmax(-1).half() for r in recs]
    data = {"head": torch.randn(V, D_BASE), "twins": torch.full((V,), -1), "eos": EOS,
            "train": (recs, rows, maps), "held": (recs[:6], rows[:6], maps[:6])}  # fmt: skip
    args = argparse.Namespace(seed=0, lr=1e-3, warmup=1, steps=2, batch=4, eos_weight=10.0,
                              eval_every=2, copy_bias=None, bonus_lr=1.0)  # fmt: skip
    arms = ("base", "tokens", "twin", "gatetwin", "twin+guess", "twin+guess+follow",
            "twin+guess+match+ends+follow+span", "twin+guess+match+point+follow+span")  # fmt: skip
    for arm in arms:
        seen: list[list] = []
        log = ca.train_arm(arm, data, args, on_eval=seen.append)
        assert [e["step"] for e in log] == [2] and len(seen) == 1
        ev = log[0]["eval"]
        assert {f: e["n"] for f, e in ev.items()} == {"question": 3, "repeat": 3}
        assert all(0.0 <= e["exact"] <= e["token_agreement"] <= 1.0 for e in ev.values())
        for e in ev.values():  # every answer that differs, counted once where it first does
            assert sum(e["first_miss"].values()) == pytest.approx(1.0 - e["exact"], abs=2e-3)
        assert ("w_point" in log[0]["bonuses"]) == ("point" in arm)


def test_the_rows_come_with_each_heads_map_from_the_prompts_last_position():
    """capture_rows with point: each lane read at its own last position (lanes of unlike
    length in one forward), rows as without."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    base = LlamaForCausalLM(cfg).eval()
    recs = [{"prompt_ids": [random.Random(n).randrange(3, V) for _ in range(n)]} for n in (5, 9)]
    rows, maps = ca.capture_rows(base, recs, point=True)
    assert ca.capture_rows(base, recs)[1] is None
    assert all(torch.equal(a, b) for a, b in zip(rows, ca.capture_rows(base, recs)[0], strict=True))
    assert [tuple(m.shape) for m in maps] == [(8, 5), (8, 9)]
    assert all(torch.allclose(m.float().sum(-1), torch.ones(8), atol=1e-2) for m in maps)


def test_an_arm_is_a_copy_mode_and_flags_in_any_combination():
    assert all(ca.valid_arm(a) for a in ca.ARMS)
    assert ca.valid_arm("twin+guess+match+ends+point+follow+span")
    for bad in ("twin+guess+guess", "twin+ends", "base+guess", "copy+guess", "twin+fast"):
        assert not ca.valid_arm(bad), bad


def test_first_miss_says_where_an_answer_departs_from_the_teachers():
    want = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, EOS]
    assert ca.first_miss(want, want, EOS) is None
    assert ca.first_miss([4, *want[1:]], want, EOS) == "start"
    assert ca.first_miss([*want[:3], 4, *want[4:]], want, EOS) == "early"
    assert ca.first_miss([*want[:9], 4, EOS], want, EOS) == "late"
    assert ca.first_miss([*want[:5], EOS], want, EOS) == "end"  # stopped too soon
    assert ca.first_miss(want[:-1], want, EOS) == "end"  # ran to the cap


def test_the_bias_option_gives_the_copy_head_a_learned_offset():
    head, twins = torch.randn(V, D_BASE), torch.full((V,), -1)
    dec = ca.new_decoder("twin+guess+match+ends", head, twins, EOS, bias=-2.0)
    assert dec.copy_head.bias.item() == -2.0 and dec.copy_head.bias.requires_grad
    assert dec.cfg.copy_match == ca.MATCH and dec.cfg.copy_match_ends
    assert ca.new_decoder("gatetwin", head, twins, EOS, bias=-2.0).copy_head.bias is None


def test_the_copy_heads_bonuses_learn_at_their_own_rate():
    head, twins = torch.randn(V, D_BASE), torch.full((V,), -1)
    dec = ca.new_decoder("twin+guess+match+ends+follow+span", head, twins, EOS, bias=None)
    rest, bonus = ca.param_groups(dec, 30.0)
    assert bonus["lr_scale"] == 30.0 and rest["lr_scale"] == 1.0
    names = {id(p): n for n, p in dec.named_parameters()}
    assert sorted(names[id(p)] for p in bonus["params"]) == [
        "copy_head.w_follow", "copy_head.w_match", "copy_head.w_span"]  # fmt: skip
    assert len(rest["params"]) + 3 == len(list(dec.parameters()))
    assert set(ca.bonuses(dec)) == {"w_follow", "w_match", "w_span"}
    assert len(ca.param_groups(ca.new_decoder("base", head, twins, EOS, None), 30.0)) == 1
