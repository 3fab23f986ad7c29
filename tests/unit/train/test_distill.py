"""Teacher exactness, distillation end to end (tiny), checkpoint identity and resume."""

import json
import shutil

import pytest
import torch

from stateblock.model.capture import lm_head_weight
from stateblock.model.checkpoint import DecoderMismatch, load_decoder, read_manifest
from stateblock.model.loading import load_base
from stateblock.train import tasks
from stateblock.train.distill import DistillConfig, train_decoder
from stateblock.train.reference import encode_examples
from stateblock.train.teacher import greedy_answers
from tests.helpers import REFERENCE_BASE

TINY = {"d_r": 32, "n_latent": 4, "n_heads": 4}


def test_teacher_equals_hf_generate_greedy():
    model, tok = load_base(REFERENCE_BASE)
    exs = [
        e
        for f in ("copy", "reverse", "add", "recall", "count", "repeat")
        for e in tasks.generate(2, split="heldout", seed=8, families=(f,))
    ]
    pairs = encode_examples(tok, exs)
    max_new = 40
    fast = greedy_answers(
        model, pairs, eos=tok.eos_token_id, pad=tok.pad_token_id, max_new=max_new, device="cpu"
    )
    deviated = 0
    for (prompt, cand), got in zip(pairs, fast, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt)),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert got == ref[0, len(prompt) :].tolist()
        deviated += got != (cand + [tok.eos_token_id])[:max_new]
    print(f"{deviated} of {len(pairs)} answers needed step-by-step decoding")


def _prompts(tmp_path, n=24):
    exs = tasks.generate(n, split="train", seed=2, families=("copy", "add", "recall", "count"))
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in exs)
    )
    return path


def test_distill_writes_a_bound_checkpoint_and_refuses_another_base(tmp_path):
    cfg = DistillConfig(steps=3, token_budget=256, max_answer=24, decoder=TINY)
    stats = train_decoder(
        REFERENCE_BASE, _prompts(tmp_path), tmp_path / "dec", cfg, data_dir=tmp_path / "data"
    )
    assert stats["steps"] == 3
    manifest = read_manifest(tmp_path / "dec")
    for key in (
        "base_model_digest",
        "lm_head_digest",
        "tokenizer_digest",
        "data_digest",
        "decoder_config",
        "decoder_digest",
    ):
        assert manifest[key], key
    assert list((tmp_path / "data").glob("teacher-*.jsonl"))  # teacher cached on disk
    model, _ = load_base(REFERENCE_BASE)
    dec, _ = load_decoder(tmp_path / "dec", base_dir=REFERENCE_BASE, lm_head=lm_head_weight(model))
    assert dec.cfg.d_r == 32

    # the same decoder against a base model whose weights differ: a clear error
    other = tmp_path / "other-base"
    shutil.copytree(REFERENCE_BASE, other)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    model.to(torch.bfloat16).save_pretrained(str(other))
    other_model, _ = load_base(other)
    with pytest.raises(DecoderMismatch, match="base_model_digest"):
        load_decoder(tmp_path / "dec", base_dir=other, lm_head=lm_head_weight(other_model))
    with pytest.raises(DecoderMismatch, match="lm_head_digest"):
        load_decoder(tmp_path / "dec", base_dir=REFERENCE_BASE, lm_head=lm_head_weight(other_model))


def test_distill_resumes_from_its_checkpoint(tmp_path):
    prompts = _prompts(tmp_path)
    cfg = DistillConfig(steps=4, token_budget=256, max_answer=24, decoder=TINY, ckpt_every=2)
    train_decoder(REFERENCE_BASE, prompts, tmp_path / "a", cfg, data_dir=tmp_path / "data")
    # the same plan cut after two steps (a time-sliced run), then resumed
    cut = DistillConfig(**{**cfg.__dict__, "stop_after": 2})
    stats = train_decoder(REFERENCE_BASE, prompts, tmp_path / "b", cut, data_dir=tmp_path / "data")
    assert stats["stopped_at"] == 2 and (tmp_path / "b" / "ckpt.pt").exists()
    assert not (tmp_path / "b" / "decoder.safetensors").exists()
    train_decoder(REFERENCE_BASE, prompts, tmp_path / "b", cfg, data_dir=tmp_path / "data")
    assert not (tmp_path / "b" / "ckpt.pt").exists()
    a = read_manifest(tmp_path / "a")["decoder_digest"]
    b = read_manifest(tmp_path / "b")["decoder_digest"]
    assert a == b  # resumed training is bit-identical to the uninterrupted run


def test_the_step_plan_fits_the_budget_again_once_early_steps_are_past():
    """Start-up 10 s, then steps of 0.2 s up to the first plan and 0.05 s after: the first
    plan (from the 0.2 s pace) is short of the budget, the second fills it."""
    from stateblock.train.reference import StepPlan

    now = [0.0]
    plan = StepPlan(5000, 80, 1.0, clock=lambda: now[0])
    steps, step = plan.planned, 0
    while step < steps:
        steps = plan.plan(step)
        now[0] += 10.0 / 10 if step < 10 else (0.2 if step < 80 else 0.05)
        if step == 80:
            first = steps
        step += 1
    assert first == 80 + int((60 - 24) / 0.2)  # 260 from the slow pace
    assert abs(now[0] - 60) < 1.0 and steps > first  # the second plan used the minute
    assert StepPlan(5000, 80, 1.0, start=100).plan(80) == 5000  # a resumed run keeps its plan


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_the_weights_stay_finite():
    """One bad batch (here: an lm_head holding a NaN, so every logit's gradient is NaN) must
    not be applied: clipping a NaN norm scales every gradient by NaN, and the run's weights
    would all be NaN from then on."""
    from contextlib import nullcontext

    from stateblock.train.distill import _batch, new_decoder, train_step

    base, tok = load_base(REFERENCE_BASE)
    lm_head = lm_head_weight(base)
    cfg = DistillConfig(decoder=TINY)
    decoder = new_decoder(base, tok, lm_head, cfg, "cpu")
    opt = torch.optim.AdamW(decoder.parameters(), lr=1e-3)
    records = [{"prompt_ids": tok.encode("copy: abc"), "answer_ids": tok.encode("abc")}] * 2
    batch = _batch(records, [0, 1], "cpu", tok.pad_token_id)
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    bad = lm_head.clone()
    bad[0, 0] = float("nan")
    loss, stepped = train_step(decoder, opt, base, bad, batch, 1e-3, nullcontext())
    assert not stepped and not torch.isfinite(loss)
    assert all(torch.equal(before[k], v) for k, v in decoder.state_dict().items())
    loss, stepped = train_step(decoder, opt, base, lm_head, batch, 1e-3, nullcontext())
    assert stepped and torch.isfinite(loss)
    after = decoder.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_a_step_moves_the_copy_heads_bonuses_at_their_own_rate():
    """AdamW's first step moves a weight by about the rate: the copy head's bonuses (few
    scalars from 0) by `bonus_lr` times it, every other weight by the rate at most."""
    from contextlib import nullcontext

    from stateblock.train.distill import _batch, bonuses, new_decoder, param_groups, train_step

    base, tok = load_base(REFERENCE_BASE)
    lm_head = lm_head_weight(base)
    copy = {"copy": "twin", "refine": 1, "copy_follow": True, "copy_match": 4, "copy_point": -1}
    decoder = new_decoder(base, tok, lm_head, DistillConfig(decoder={**TINY, **copy}), "cpu")
    heads = base.config.num_hidden_layers * base.config.num_attention_heads
    assert decoder.cfg.copy_point == heads  # -1: every head of the base
    opt = torch.optim.AdamW(param_groups(decoder, 30.0), lr=1e-3, weight_decay=0.0)
    records = [{"prompt_ids": tok.encode("copy: abcab"), "answer_ids": tok.encode("abcab")}] * 2
    before = {n: p.detach().clone() for n, p in decoder.named_parameters()}
    _, stepped = train_step(decoder, opt, base, lm_head, _batch(records, [0, 1], "cpu",
                            tok.pad_token_id), 1e-3, nullcontext())  # fmt: skip
    assert stepped
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in decoder.named_parameters()}
    assert max(v for n, v in moved.items() if not n.startswith("copy_head.w_")) < 1.01e-3
    assert moved["copy_head.w_follow"] > 0.02 and moved["copy_head.w_match"] > 0.02
    assert moved["copy_head.w_point_scale"] > 0.02  # the base's attention maps reached the head
    assert set(bonuses(decoder)) == {"w_follow", "w_match", "w_point", "w_point_scale"}
    # served as evaluated: the maps are taken in the same forward as the rows
    from stateblock.train.prose_fidelity import readout_answers

    got = readout_answers(base, decoder.eval(), records, 6, tok.pad_token_id, "cpu")
    assert [len(a) for a in got] == [6, 6]
