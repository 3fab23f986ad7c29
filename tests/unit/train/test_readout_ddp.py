"""The fresh-prompt readout trainer: its one-forward teacher equals the step-by-step
teacher's verified prefix, its rows equal the serving capture's, and a run resumes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stateblock.model.capture import capture
from stateblock.model.checkpoint import DecoderMismatch, load_decoder
from stateblock.model.loading import load_base
from stateblock.train import readout_ddp, tasks
from stateblock.train.base_ddp import FastEnc
from stateblock.train.teacher import verify_candidates

BASE = Path(__file__).resolve().parents[3] / "models" / "reference" / "base"
pytestmark = pytest.mark.skipif(not BASE.exists(), reason="models/reference/base not in this tree")


@pytest.fixture(scope="module")
def base():
    return load_base(BASE, "cpu")


def test_one_forward_teacher_equals_verified_prefix_and_rows_equal_capture(base):
    model, tok = base
    enc = FastEnc(BASE)
    exs = tasks.per_family(3, split="heldout", seed=77)
    exs = [e for e in exs if len(e.answer) < 200]
    pairs = [(enc.prompt(e.prompt), enc.answer(e.answer)) for e in exs]
    # a wrong candidate for two prompts: the teacher deviates from it, at a known position
    pairs[0] = (pairs[0][0], pairs[0][1][:-1] + [pairs[0][1][0] ^ 1] if pairs[0][1] else [5])
    pairs[3] = (pairs[3][0], list(reversed(pairs[3][1])) + pairs[3][1])
    lens = [len(p) + len(a) + 1 for p, a in pairs]
    ids = torch.full((len(pairs), max(lens)), enc.pad)
    lab = torch.full_like(ids, -100)
    for r, (p, a) in enumerate(pairs):
        ids[r, : lens[r]] = torch.tensor(p + a + [enc.eos])
        lab[r, len(p) - 1 : lens[r] - 1] = torch.tensor(a + [enc.eos])
    off = torch.autocast("cpu", enabled=False)
    rows, plens, target, info = readout_ddp.teacher_batch(model, ids, lab, off)
    want = verify_candidates(model, pairs, enc.eos, enc.pad, "cpu", 1 << 16, 4096)
    deviating = 0
    for r, w in enumerate(want):
        got = [t for t in target[r].tolist() if t != -100]
        assert got == w, r  # truth up to the deviation, the teacher's own token at it
        deviating += w != (pairs[r][1] + [enc.eos])
    assert deviating >= 2 and info["teacher_deviates"] == deviating
    assert plens.tolist() == [len(p) for p, _ in pairs]
    for r, (p, _) in enumerate(pairs[:4]):  # the serving capture of the prompt alone
        alone = capture(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        # fp32 rounding of a padded batch against one prompt, through 8 layers: up to 1.3e-4
        # on rows of magnitude 6 with AVX-512 kernels; a wrong offset or a leak is O(1)
        torch.testing.assert_close(rows[r, : len(p)], alone[0], atol=5e-4, rtol=0)


class _Exited(BaseException):
    pass


def test_a_run_writes_a_bound_decoder_and_resumes(tmp_path, base, monkeypatch):
    model, _ = base
    args = ["--base", str(BASE), "--out", str(tmp_path), "--device", "cpu", "--workers", "0",
            "--budget", "2048", "--max-batch", "8", "--pool", "64", "--eval-each", "1",
            "--near-end-weight", "3",  # the hard-negative weights' path, exercised
            "--decoder-config", json.dumps({"d_r": 32, "n_latent": 4, "n_heads": 4,
                                            "n_mixer": 1, "row_attn": True, "refine": 1})]  # fmt: skip

    def no_exit(code: int) -> None:  # main() ends with os._exit (its loader workers)
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", no_exit)  # base_ddp.leave ends the run with it
    for steps in ("3", "2"):  # each run also profiles from its second step, for 2 steps
        with pytest.raises(_Exited):
            readout_ddp.main([*args, "--max-steps", steps, "--profile-steps", "2",
                              "--profile-from", "1"])  # fmt: skip
        profile = (tmp_path / "profile.txt").read_text()
        # the second run ends inside its window: the profiler stops with it, one step seen
        seen = {"3": 2, "2": 1}[steps]
        assert profile.startswith(f"{seen} steps from step 1 of this run:"), profile[:80]
        assert "ms/step wall" in profile and "top operators by self_cpu_time_total" in profile
        assert "aten::" in profile
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["steps"] == 5 and stats["steps_this_run"] == 2  # the second run resumed
    state = torch.load(tmp_path / "state.pt")
    assert state["origin"] == 0  # one warm-up + cosine across both runs, not one each
    assert stats["config"]["decoder"]["refine"] == 1
    dec, manifest = load_decoder(tmp_path / "decoder", base_dir=BASE, lm_head=model.lm_head.weight)
    assert dec.cfg.row_attn and dec.cfg.refine == 1
    assert manifest["training"]["config"]["max_answer"] == 3100
    assert set(stats["heldout"]["exact_by_family"]) <= set(tasks.FAMILIES)
    gap = stats["train_minus_heldout_exact"]  # the train - held-out gap, bucket by bucket
    assert gap and set(gap) <= set(stats["train_split"]["exact_by_bucket"])
    # another machine's stage: no state file there, the saved decoder as its start
    # its shape from the saved manifest, with passes (which share their weights) overridable
    args[args.index("--out") + 1] = str(tmp_path / "next")
    args[args.index("--decoder-config") + 1] = json.dumps({"refine": 2})
    with pytest.raises(_Exited):
        readout_ddp.main([*args, "--max-steps", "1", "--init", str(tmp_path / "decoder")])
    again = json.loads((tmp_path / "next" / "stats.json").read_text())
    assert again["steps"] == 6 and again["config"]["decoder"]["row_attn"] is True
    assert again["config"]["decoder"]["d_r"] == 32 and again["config"]["decoder"]["refine"] == 2
    # a base stage ran since: the last decoder starts the next one on the new base, and what
    # that run saves is bound to the new base, not the old
    other = tmp_path / "base6"
    shutil.copytree(BASE, other)
    weights = load_file(str(other / "model.safetensors"))
    key = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[key] = weights[key] * 1.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    args[args.index("--base") + 1] = str(other)
    args[args.index("--out") + 1] = str(tmp_path / "rebased")
    with pytest.raises(_Exited):
        readout_ddp.main([*args, "--max-steps", "1", "--init", str(tmp_path / "decoder")])
    lm_head = load_base(other, "cpu")[0].lm_head.weight
    load_decoder(tmp_path / "rebased" / "decoder", base_dir=other, lm_head=lm_head)
    with pytest.raises(DecoderMismatch):
        load_decoder(tmp_path / "rebased" / "decoder", base_dir=BASE, lm_head=lm_head)


def test_step_by_step_decoding_reports_every_step(base):
    """The teacher's decode progress moves on every step (a long answer is many steps,
    where a per-batch bar sat at 0/1 for minutes)."""
    from stateblock.train.teacher import greedy_continue

    model, _ = base
    enc = FastEnc(BASE)
    steps = []
    out = greedy_continue(model, [enc.prompt("count: 001 009")], 12, enc.eos, enc.pad, "cpu",
                          on_step=lambda: steps.append(1))  # fmt: skip
    assert len(steps) == 12 and len(out[0]) == 12  # 12 steps, no EOS within 12 tokens


def test_a_schedule_longer_than_its_run_is_planned_long_and_stops_on_the_clock(monkeypatch):
    """A device call lasts 10 minutes; the cosine may span several: the plan fills
    `plan_minutes` at the measured pace while the run stops after `minutes`."""
    from stateblock.train import base_ddp

    clock = [0.0]
    monkeypatch.setattr(base_ddp.time, "perf_counter", lambda: clock[0])
    r = base_ddp.Ranks(ddp=False, rank=0, world=1, device="cpu")
    plan = base_ddp.Plan(r, 0, None, minutes=1.0, max_steps=10**9, fallback=4000, plan_minutes=10)
    step = 0
    while True:
        plan.steps(step)
        clock[0] += 0.1  # 100 ms a step
        step += 1
        if plan.done(step):
            break
    assert 5900 <= plan.total <= 6000  # 10 minutes at 100 ms a step
    assert 590 <= step <= 610  # but this run ended after its one minute
    assert plan.bar.total == plan.total  # the progress bar shows the planned length


def test_a_run_whose_pace_falls_after_its_plan_still_stops_on_the_clock(monkeypatch, tmp_path):
    """Under torchrun too (a process group, here of one rank over gloo): a pace measured at
    steps 100-300 that falls later (runs sharing a GPU) must not carry a run past its call."""
    import torch.distributed as dist

    from stateblock.train import base_ddp

    clock = [0.0]
    monkeypatch.setattr(base_ddp.time, "perf_counter", lambda: clock[0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        r = base_ddp.Ranks(ddp=True, rank=0, world=1, device="cpu")
        plan = base_ddp.Plan(r, 0, None, minutes=1.0, max_steps=10**9, fallback=4000)
        step = 0
        while True:
            plan.steps(step)
            clock[0] += 0.1 if step < 300 else 0.3  # the pace falls 3x after the plan
            step += 1
            if plan.done(step):
                break
    finally:
        dist.destroy_process_group()
    assert 550 <= plan.total <= 620  # planned to fill the minute at 100 ms a step
    # stopped 30 s past it (rank 0's clock is read every 10th step), not at 2.2 minutes
    assert step < plan.total and 90 <= clock[0] <= 93.1


def test_the_answer_loss_weights_eos_and_skips_unscored_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.tensor([[3, 4, 2, -100, -100], [5, 6, 7, 8, 2]])  # EOS = 2
    plain = readout_ddp.answer_loss(logits, target, eos=2)
    assert torch.allclose(plain, torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=-100))  # fmt: skip
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                           ignore_index=-100, reduction="none")  # fmt: skip
    eos = target.flatten() == 2
    want = (ce[~eos].sum() + 10 * ce[eos].sum()) / (int((target != -100).sum()) - 2 + 20)
    assert torch.allclose(readout_ddp.answer_loss(logits, target, eos=2, eos_weight=10), want)


def test_the_stop_loss_compares_a_lanes_positions_and_skips_lanes_without_an_end():
    eos, v = 2, 7
    target = torch.tensor([[3, 4, 2, -100], [5, 6, -100, -100]])  # lane 1: no EOS target
    logits = torch.zeros(2, 4, v)
    logits[0, 2, eos] = 6.0  # the true end: EOS confident
    good = readout_ddp.stop_loss(logits, target, eos)
    spurious = logits.clone()
    spurious[0, 1, eos] = 8.0  # an earlier position more sure of EOS than the end
    bad = readout_ddp.stop_loss(spurious, target, eos)
    assert float(good) < 0.05 < 1.0 < float(bad)
    late = logits.clone()
    late[0, 3, eos] = 8.0  # past the end counts too: the end is one decision per lane
    assert float(readout_ddp.stop_loss(late, target, eos)) > 1.0
    lane1 = logits.clone()
    lane1[1, :, eos] = torch.tensor([9.0, -9.0, 9.0, -9.0])  # not scored: no end known
    assert torch.allclose(readout_ddp.stop_loss(lane1, target, eos), good)
    none = torch.full_like(target, -100)
    grad = torch.zeros(2, 4, v, requires_grad=True)
    readout_ddp.stop_loss(grad, none, eos).backward()  # nothing scored, a graph all the same
    assert float(grad.grad.abs().sum()) == 0.0


def test_near_end_weights_mark_separators_after_items_one_character_from_the_last():
    sep, eos = 1, 2
    ids = {c: 10 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789")}

    def lane(text: str, end: bool = True, width: int = 24) -> list[int]:
        toks = [sep if c == " " else ids[c] for c in text] + ([eos] if end else [])
        return toks + [-100] * (width - len(toks))

    target = torch.tensor([
        lane("hnc hzb hzc"),  # hnc and hzb are one character from hzc: both their separators
        lane("abc xyd abd"),  # xyd is two away; abc is one away
        lane("hnc hzb hzc", end=False),  # no known end: nothing weighted
        lane("ab001 ab011 ab003"),  # longer items (repeat): ab001 is one away, ab011 two
    ])  # fmt: skip
    w = readout_ddp.near_end_weights(target, eos, sep, 5.0)
    marked = [(w[r] == 5.0).nonzero().flatten().tolist() for r in range(4)]
    assert marked == [[3, 7], [3], [], [5]]
    assert bool((w[w != 5.0] == 1.0).all())
    logits = torch.randn(4, 24, 50)
    base = readout_ddp.answer_loss(logits, target, eos)
    assert torch.allclose(
        readout_ddp.answer_loss(logits, target, eos, extra=torch.ones(4, 24)), base
    )
    assert not torch.allclose(readout_ddp.answer_loss(logits, target, eos, extra=w), base)


def test_two_ranks_over_gloo_train_one_decoder_and_a_single_process_resumes_it(tmp_path, base):
    """`stateblock train` scales by torchrun: two CPU ranks (gloo, the NCCL job's code path
    on the CPU) draw their own prompts, end with equal weights, and rank 0's state file
    resumes in one process without torchrun."""
    import subprocess
    import sys

    cfg = {"d_r": 32, "n_latent": 4, "n_heads": 4, "n_mixer": 1, "row_attn": True, "refine": 1}
    args = ["-m", "stateblock.train.readout_ddp", "--base", str(BASE), "--out", str(tmp_path),
            "--device", "cpu", "--workers", "0", "--budget", "2048", "--max-batch", "8",
            "--pool", "64", "--eval-each", "0", "--decoder-config", json.dumps(cfg)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for launch, steps in ((torchrun, "3"), ([sys.executable], "2")):
        done = subprocess.run([*launch, *args, "--max-steps", steps], cwd=BASE.parents[2],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        stats = json.loads((tmp_path / "stats.json").read_text())
        if launch is torchrun:
            assert stats["world"] == 2 and stats["ranks_agree"] is True
            # each rank's lanes are counted: rank 0's batch times the world
            assert stats["prompts_seen"] > 0 and stats["prompts_seen"] % 2 == 0
            two_rank_seen = stats["prompts_seen"]
    assert stats["world"] == 1 and stats["ranks_agree"] is True
    assert stats["steps"] == 5 and stats["steps_this_run"] == 2  # resumed at step 3
    assert stats["prompts_seen"] > two_rank_seen
    model, _ = base
    load_decoder(tmp_path / "decoder", base_dir=BASE, lm_head=model.lm_head.weight)


def _agree_worker(rank: int, init: str, nudge: bool, out: str) -> None:
    import torch.distributed as dist

    from stateblock.train.base_ddp import Ranks, ranks_agree

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    if nudge and rank == 1:  # one weight one ulp away: a replica that drifted
        with torch.no_grad():
            model.weight[2, 3] = torch.nextafter(model.weight[2, 3], torch.tensor(9.0))
    r = Ranks(ddp=True, rank=rank, world=2, device="cpu")
    Path(out, f"{rank}").write_text(str(ranks_agree(model, r)))
    dist.destroy_process_group()


@pytest.mark.parametrize("nudge", [False, True])
def test_ranks_agree_sees_one_replica_one_ulp_away(tmp_path, nudge):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/pg"
    mp.spawn(_agree_worker, args=(init, nudge, str(tmp_path)), nprocs=2, join=True)
    verdicts = {(tmp_path / f"{r}").read_text() for r in (0, 1)}
    assert verdicts == {"False" if nudge else "True"}  # every rank reaches the same verdict


def test_more_latent_slots_start_from_the_trained_ones_tiled_and_nudged():
    from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder

    cfg = dict(d_base=16, vocab_size=12, eos_token_id=2, d_r=16, n_latent=4, n_heads=2)
    small = ReadoutDecoder(ReadoutConfig(**cfg)).state_dict()
    wide = readout_ddp.widen_latents(small, 12)
    lat, old = wide["latent"], small["latent"]
    assert lat.shape == (12, 16) and torch.equal(lat[:4], old)  # the trained slots, first
    for copy in (lat[4:8], lat[8:]):  # each further copy near them, and no two alike
        assert not torch.equal(copy, old) and (copy - old).abs().max() < old.abs().max()
    assert not torch.equal(lat[4:8], lat[8:])
    ReadoutDecoder(ReadoutConfig(**{**cfg, "n_latent": 12})).load_state_dict(wide)
    assert readout_ddp.widen_latents(small, 4) is small
    with pytest.raises(ValueError, match="multiple"):
        readout_ddp.widen_latents(small, 6)


@pytest.mark.parametrize("grow", [{"n_mixer": 2, "n_ref_mixer": 1}, {"n_ref_mixer": 2}])
def test_a_deeper_stack_starts_as_the_trained_decoder_and_its_new_layer_learns(grow):
    from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder

    cfg = dict(d_base=16, vocab_size=12, eos_token_id=2, d_r=16, n_latent=4, n_heads=2,
               n_mixer=1, row_attn=True, refine=1, rope=True)  # fmt: skip
    torch.manual_seed(0)
    small = ReadoutDecoder(ReadoutConfig(**cfg))
    deep = ReadoutDecoder(ReadoutConfig(**{**cfg, **grow}))
    deep.load_state_dict(readout_ddp.deepen(small.state_dict(), deep))
    new = sorted(deep.state_dict().keys() - small.state_dict().keys())
    stacks = ("mixer.1.", "row_cross.1.") if "n_mixer" in grow else ("ref_mixer.1.", "ref_cross.1.")
    assert new and {".".join(k.split(".")[:2]) + "." for k in new} == set(stacks)
    rows, lens = torch.randn(2, 5, 16), torch.tensor([5, 3])
    pos, head = torch.arange(6).expand(2, 6), torch.randn(12, 16)
    before, after = (
        small.pass_logits(rows, lens, pos, head),
        deep.pass_logits(rows, lens, pos, head),
    )
    assert len(before) == len(after) == 2
    for b, a in zip(before, after, strict=True):  # the identity start: the same logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    after[-1].logsumexp(-1).sum().backward()
    wo = dict(deep.named_parameters())[f"{stacks[0]}attn.wo.weight"]
    assert float(wo.detach().abs().max()) == 0.0 and float(wo.grad.abs().max()) > 0.0
    with pytest.raises(ValueError, match="lacks"):  # a shallower decoder is not a deepening
        readout_ddp.deepen(deep.state_dict(), ReadoutDecoder(ReadoutConfig(**cfg)))
    with pytest.raises(ValueError, match="not a layer"):  # nor is a new refinement pass
        readout_ddp.deepen(
            ReadoutDecoder(ReadoutConfig(**{**cfg, "refine": 0})).state_dict(), small
        )
