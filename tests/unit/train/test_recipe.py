"""`stateblock build-reference`: the shipped pair's recipe as commands, and a smoke run of
every stage on the CPU (one step each) that leaves a base and a decoder bound to it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from stateblock.model.checkpoint import load_decoder
from stateblock.model.decoder import ReadoutConfig
from stateblock.model.loading import load_base
from stateblock.train import recipe

ROOT = Path(__file__).resolve().parents[3]


def test_the_plan_is_the_recorded_stages_on_every_gpu_or_the_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    every = recipe.plan(out, work, "all", 1, ngpu=2)
    assert len(every) == len(recipe.STAGES) == 32
    assert all(c[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"] for c in every)
    # the decoder stages read the base the base stages wrote, or, alone, the one in --out
    assert every[8][every[8].index("--base") + 1] == str(work / "base-run" / "base")
    alone = recipe.plan(out, work, "decoder", 3, ngpu=0)
    assert len(alone) == 22 and alone[0][1:3] == ["-m", recipe.READOUT]
    assert alone[0][alone[0].index("--base") + 1] == str(out / "base")
    assert "--device" in alone[0] and "--eos-weight" in alone[0]
    cfg = json.loads(every[8][every[8].index("--decoder-config") + 1])
    assert cfg["rope"] and cfg["row_attn"] and cfg["refine"] == 1
    try:
        recipe.plan(out, work, "base", 9, ngpu=0)
    except ValueError as e:
        assert "--start must be 1 to 8" in str(e)
    else:
        raise AssertionError("a start past the last stage was accepted")


def test_a_smoke_build_runs_every_stage_and_binds_the_decoder_to_its_base(tmp_path):
    out = tmp_path / "models"
    cmd = [sys.executable, "-m", "stateblock.app.cli", "build-reference", "--out", str(out),
           "--work-dir", str(tmp_path / "work"), "--smoke", "1"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("+ ") == 32  # every stage ran
    base, _ = load_base(out / "base", "cpu")
    dec, manifest = load_decoder(
        out / "decoder", base_dir=out / "base", lm_head=base.lm_head.weight
    )
    assert manifest["training"]["steps"] == 24  # the twenty-four decoder stages, one step each
    assert dec.cfg.rope and dec.cfg.refine == 1 and dec.cfg.row_attn
    assert all(torch.isfinite(p).all() for p in dec.parameters())


def test_train_without_prompts_launches_the_suite_trainer(capsys):
    """`stateblock train` on the task suite: the DDP trainer under torchrun on every GPU, or
    one CPU process; the shipped decoder's shape unless told otherwise."""
    from stateblock.app import cli

    argv = ["train", "--base", "B", "--out", "O", "--dry-run", "--trainer-args", "--eos-weight 10"]
    assert cli.main([*argv, "--device", "cpu"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:4] == [sys.executable, "-m", recipe.READOUT] and cmd[-2:] == ["--eos-weight", "10"]
    assert "--device" in cmd and '"rope":' in " ".join(cmd)
    assert cli.main([*argv, "--device", "cuda", "--gpus", "2"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:4] == ["torchrun", "--standalone", "--nproc_per_node=2"]


def test_a_rebuild_lands_in_models_through_the_package_link(tmp_path):
    """build-reference's default --out is the package's stateblock/reference, in a checkout
    a link to models/reference: a stage's result replaces the files there, the link stays."""
    from stateblock import runtime
    from stateblock.app.cli import build_parser

    assert Path(build_parser().parse_args(["build-reference"]).out) == runtime.REFERENCE
    models = tmp_path / "models" / "reference" / "base"
    models.mkdir(parents=True)
    (models / "stale.json").write_text("{}")
    link = tmp_path / "stateblock" / "reference"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "models" / "reference")
    stage = tmp_path / "work" / "base-run" / "base"
    stage.mkdir(parents=True)
    (stage / "config.json").write_text("{}")
    recipe._replace(stage, link / "base")
    assert link.is_symlink()
    assert [p.name for p in models.iterdir()] == ["config.json"]


def test_the_prose_recipe_needs_its_corpus_and_an_out_of_its_own(capsys):
    from stateblock.app import cli

    assert cli.main(["build-reference", "--recipe", "prose", "--corpus", "c"]) == 2
    assert "--out of its own" in capsys.readouterr().err  # never over the shipped pair
    assert cli.main(["build-reference", "--recipe", "prose", "--out", "o"]) == 2
    capsys.readouterr()
    argv = ["build-reference", "--recipe", "prose", "--corpus", "c", "--out", "o", "--dry-run",
            "--scale", "tiny", "--device", "cpu"]  # fmt: skip
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["work"] == "runs/prose" and plan["scale"] == "tiny" and plan["out"] == "o"
    assert plan["copy"] == "" and plan["copy_guess"] == 0
    assert cli.main([*argv, "--copy", "twin", "--copy-guess", "4"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["copy"] == "twin" and plan["copy_guess"] == 4
    from stateblock.model.copy_head import MODES  # the CLI lists them without importing torch

    for mode in (*MODES, "none"):
        assert cli.main([*argv, "--copy", mode]) == 0
    capsys.readouterr()


def test_the_bench_scale_reads_with_the_best_copy_head_unless_told_otherwise():
    from stateblock.train import prose_readout as pr

    ap, bench = pr.parser(), pr.SCALES["bench"]
    cfg = pr.distill_config(ap.parse_args(["--work", "w"]), bench).decoder
    assert {k: cfg[k] for k in pr.PROSE_COPY} == pr.PROSE_COPY
    ReadoutConfig(d_base=8, vocab_size=9, eos_token_id=1, **cfg)  # a valid decoder
    cfg = pr.distill_config(ap.parse_args(["--work", "w", "--copy", "none"]), bench).decoder
    assert cfg["copy"] == "" and not cfg["copy_match"] and not cfg["copy_match_ends"]
    cfg = pr.distill_config(ap.parse_args(["--work", "w", "--copy", "joint"]), bench).decoder
    assert cfg["copy"] == "joint" and cfg["copy_guess"] == 0 and not cfg["copy_follow"]
    assert cfg["copy_point"] == 0
    argv = ["--work", "w", "--copy", "twin", "--copy-point"]
    assert pr.distill_config(ap.parse_args(argv), bench).decoder["copy_point"] == -1  # every head
    assert (
        "copy" not in pr.distill_config(ap.parse_args(["--work", "w"]), pr.SCALES["tiny"]).decoder
    )


def test_an_arm_overrides_the_scale_s_sizes_and_nothing_else():
    from stateblock.train import prose_readout

    ap = prose_readout.parser()
    bench = prose_readout.SCALES["bench"]
    same = prose_readout.with_overrides(bench, ap.parse_args([]))
    assert same == bench
    arm = prose_readout.with_overrides(
        bench,
        ap.parse_args(
            [
                "--train-prompts",
                "50000",
                "--tune-minutes",
                "2",
                "--tune-steps",
                "6000",
                "--distill-minutes",
                "4",
                "--distill-lr",
                "3e-4",
            ]  # fmt: skip
        ),
    )
    assert (arm.train_prompts, arm.tune.max_minutes, arm.distill.max_minutes) == (50000, 2.0, 4.0)
    assert arm.distill.lr == 3e-4 and bench.distill.lr != 3e-4
    assert arm.tune == replace(bench.tune, max_minutes=2.0, steps=6000)
    assert replace(arm.distill, max_minutes=bench.distill.max_minutes, lr=bench.distill.lr) == (
        bench.distill
    )
    assert (
        replace(arm, train_prompts=bench.train_prompts, tune=bench.tune, distill=bench.distill)
        == bench
    )
