"""The model-building commands of `stateblock`: build-reference (the shipped pair's
recipe, or the prose pair's), train (a readout decoder for a base model) and eval (the quality report)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from stateblock import settings
from stateblock.runtime import REFERENCE

DEFAULTS = argparse.ArgumentDefaultsHelpFormatter  # every flag shows its default


def command(sub, name: str, fn, help_: str) -> argparse.ArgumentParser:
    """The subcommand `name` of `sub`, running `fn(args)`; its flags show their defaults."""
    parser = sub.add_parser(name, formatter_class=DEFAULTS, help=help_)
    parser.set_defaults(fn=fn)
    return parser


def device_of(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def cmd_build_reference(a: argparse.Namespace) -> int:
    if a.recipe == "prose":
        return _build_prose(a)
    from stateblock.train import recipe

    out, work = Path(a.out), Path(a.work_dir or "runs/reference")
    if a.dry_run:
        ngpu = recipe.gpu_count()
        for cmd in recipe.plan(out, work, a.stage, a.start, ngpu, a.smoke):
            print(shlex.join(cmd))
        return 0
    recipe.build(out, work, a.stage, a.start, a.smoke)
    return 0


def _build_prose(a: argparse.Namespace) -> int:
    """The prose pair (stateblock/train/prose_readout.py): every stage, resumable."""
    from stateblock.train import prose_readout

    if not a.corpus or Path(a.out) == REFERENCE:
        print("stateblock build-reference --recipe prose needs --corpus and an --out of its "
              "own (the shipped reference pair stays where it is)", file=sys.stderr)  # fmt: skip
        return 2
    args = prose_readout.parser().parse_args([])  # every other flag at its default: the scale's
    vars(args).update(
        corpus=a.corpus, work=a.work_dir or "runs/prose", out=a.out,
        scale=a.scale, tokenizer=a.tokenizer, base=a.base, base_weights=a.base_weights,
        device=device_of(a.device), seed=a.seed, copy=a.copy, copy_guess=a.copy_guess,
    )  # fmt: skip
    if a.dry_run:
        print(json.dumps(vars(args)))
        return 0
    prose_readout.build(args)
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    if a.prompts is None:  # the task suite: fresh prompts, torchrun on every GPU
        return _train_suite(a)
    from stateblock.train.distill import DistillConfig, train_decoder

    cfg = DistillConfig(
        steps=a.steps,
        token_budget=a.token_budget,
        max_answer=a.max_answer,
        lr=a.lr,
        seed=a.seed,
        decoder=json.loads(a.decoder_config or "{}"),
    )
    stats = train_decoder(
        a.base, a.prompts, a.out, cfg, device=device_of(a.device), data_dir=a.data_dir
    )
    print(json.dumps(stats))
    return 0


def _train_suite(a: argparse.Namespace) -> int:
    import subprocess

    from stateblock.train import recipe

    ngpu = 0 if device_of(a.device) == "cpu" else (a.gpus or recipe.gpu_count())
    config = a.decoder_config or json.dumps(recipe.DECODER_CONFIG)  # the shipped decoder's
    args = ["--base", a.base, "--out", a.out, "--minutes", str(a.minutes), "--lr", str(a.lr),
            "--seed", str(a.seed), "--decoder-config", config]  # fmt: skip
    cmd = recipe.launcher(recipe.READOUT, ngpu, args, shlex.split(a.trainer_args))
    print("+", shlex.join(cmd), flush=True)
    if a.dry_run:
        return 0
    return subprocess.run(cmd).returncode


def cmd_eval(a: argparse.Namespace) -> int:
    from stateblock.tools import evaluate

    decoders = a.decoder or [str(REFERENCE / "decoder")]
    if len(decoders) > 1 and a.plot:
        print("stateblock eval: --plot takes one --decoder", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    reports = evaluate.evaluate_many(
        a.base,
        decoders,
        n_each=a.n_each,
        seed=a.seed,
        device=device_of(a.device),
        families=tuple(a.families.split(",")) if a.families else None,
        max_answer=a.max_answer,
        capture_compile=a.capture_compile,
        capture_rope=a.capture_rope,
    )
    seconds = round(time.perf_counter() - t0, 1)
    for report, d in zip(reports, decoders, strict=True):
        report["settings"]["seconds"] = seconds
        if len(decoders) > 1:
            report["settings"]["decoder"] = d
    command = "stateblock " + shlex.join(a.argv)
    if len(decoders) == 1:
        report = reports[0]
        if a.json:
            evaluate.write_json(report, a.json)
        if a.plot:
            evaluate.plot(report, a.plot)
        if a.markdown:
            Path(a.markdown).write_text(evaluate.markdown(report, command))
        print(json.dumps(report, indent=2))
        return 0
    # several decoders on one teacher pass: the JSON holds a list, stdout the comparison
    table = evaluate.comparison(reports, decoders)
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=2) + "\n")
    if a.markdown:
        sections = [
            f"## {d}\n\n" + evaluate.markdown(r, command)
            for d, r in zip(decoders, reports, strict=True)
        ]
        Path(a.markdown).write_text(table + "\n" + "\n".join(sections))
    print(table, end="")
    return 0


def _build_reference_parser(sub) -> None:
    b = command(
        sub,
        "build-reference",
        cmd_build_reference,
        "build a pair: the shipped reference's recipe (stateblock/train/recipe.py), or the "
        "prose pair's (stateblock/train/prose_readout.py)",
    )
    b.add_argument(
        "--recipe",
        choices=["reference", "prose"],
        default="reference",
        help="reference: the synthetic pair's stages; prose: base, tasks, tuned base, "
        "teacher, readout, evaluation on an English corpus (docs/CORPUS.md)",
    )
    b.add_argument(
        "--out",
        default=str(REFERENCE),
        help="where base/ and decoder/ go (prose: required, never the shipped pair's place)",
    )
    b.add_argument(
        "--work-dir",
        default=None,
        help="the stages' outputs and state files (default: runs/reference or runs/prose)",
    )
    b.add_argument(
        "--stage",
        choices=["all", "base", "decoder"],
        default="all",
        help="reference: which model to build (decoder: against the base already in --out)",
    )
    b.add_argument(
        "--start", type=int, default=1, help="reference: the first chosen stage to run (resume)"
    )
    b.add_argument(
        "--smoke",
        type=int,
        default=0,
        help="reference: >0, a smoke run, this many steps a stage, tiny batches",
    )
    b.add_argument("--dry-run", action="store_true", help="print the stages' commands and stop")
    b.add_argument("--corpus", default="", help="prose: train.txt and heldout.txt (corpus.py)")
    b.add_argument("--scale", choices=["tiny", "bench"], default="bench", help="prose: sizes")
    b.add_argument("--tokenizer", default="", help="prose: a BPE directory (default: built)")
    b.add_argument("--base", default="", help="prose: a document-trained base directory")
    b.add_argument("--base-weights", default="", help="prose: a prose_stage weights prefix")
    b.add_argument("--device", default="auto", help="prose: cuda, cpu, or auto")
    b.add_argument("--seed", type=int, default=0, help="prose: tasks, tuning, readout")
    b.add_argument("--copy", choices=["", "none", "twin", "joint", "gate", "gatetwin"], default="",
                   help="prose: the readout's copy head, or none (default: the scale's: at "
                        "bench the ablations' best, at tiny none; served by the reference "
                        "engine only)")  # fmt: skip
    b.add_argument("--copy-guess", type=int, default=0,
                   help="prose, with --copy: the base's top-N first tokens among the copy "
                        "head's candidates (docs/QUALITY.md: twin with 4 reads best)")  # fmt: skip


def add_parsers(sub) -> None:
    _build_reference_parser(sub)

    t = command(sub, "train", cmd_train, "distil a readout decoder from a base model")
    t.add_argument("--base", required=True, help="local Hugging Face model directory")
    t.add_argument(
        "--prompts",
        default=None,
        help="JSONL with a 'prompt' per line: distil on these (one process). Without it: fresh "
        "task-suite prompts every step, under torchrun (DDP) on every GPU, or on the CPU",
    )
    t.add_argument("--minutes", type=float, default=8.0, help="task suite: wall-clock budget")
    t.add_argument("--gpus", type=int, default=0, help="task suite: GPUs to use (0: all)")
    t.add_argument(
        "--trainer-args",
        default="",
        help="task suite: more options of python -m stateblock.train.readout_ddp, one string",
    )
    t.add_argument("--dry-run", action="store_true", help="task suite: print the command, stop")
    t.add_argument("--out", required=True, help="the decoder directory to write")
    t.add_argument("--data-dir", default="data", help="the teacher cache")
    t.add_argument("--device", default="auto", help="cuda, cpu, or auto")
    t.add_argument("--steps", type=int, default=6000, help="optimizer steps")
    t.add_argument("--token-budget", type=int, default=49152, help="answer positions a step")
    t.add_argument(
        "--max-answer", type=int, default=4096, help="longest supervised answer (tokens)"
    )
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--seed", type=int, default=0, help="random seed")
    t.add_argument(
        "--decoder-config",
        default="",
        help="JSON ReadoutConfig overrides (task suite default: the shipped decoder's shape)",
    )

    e = command(sub, "eval", cmd_eval, "quality report on held-out prompts")
    e.add_argument("--base", default=str(REFERENCE / "base"), help="base model directory")
    e.add_argument(
        "--decoder",
        action="append",
        help="decoder directory (default: the shipped one); given more than once, every "
        "decoder is judged against one teacher pass and stdout is their comparison table",
    )
    e.add_argument("--n-each", type=int, default=40, help="held-out prompts per family")
    e.add_argument("--seed", type=int, default=1234, help="seed of the held-out prompts")
    e.add_argument("--families", default="", help="comma-separated subset")
    e.add_argument("--device", default="auto", help="cuda, cpu, or auto")
    e.add_argument("--max-answer", type=int, default=None, help="teacher envelope override")
    e.add_argument(
        "--capture-compile",
        default="off",
        help="read the rows the compiled capture service gives (a torch.compile backend or "
        "mode, e.g. `default` on a GPU: no mask, SDPA unmasked); `off`: a masked eager capture",
    )
    e.add_argument(
        "--capture-rope",
        choices=settings.CAPTURE_ROPE_MODES,
        default=settings.CAPTURE_ROPE.default,
        help="with --capture-compile: the rotary's cos and sin as the capture's "
        "STATEBLOCK_CAPTURE_ROPE evaluates them",
    )
    e.add_argument("--json", help="write the JSON report here")
    e.add_argument("--plot", help="write the PNG plot here")
    e.add_argument("--markdown", help="write the markdown tables here")
