"""How the shipped reference pair was built, as data: the base model's eight stages and the
readout decoder's twenty-four, each one trainer run (`base_ddp`, `readout_ddp`) that resumes the
last from its state file, sized to fit one 10-minute device call. `stateblock build-reference` runs
them in order (under torchrun on every GPU of the machine, or in-process on the CPU) and copies
the results into the model directory; docs/QUALITY.md has each stage's figures.

Base stages 1-4 ran on two H200s, 5-8 and the decoder stages on one; the step counts follow the
machine's pace (each run plans its cosine from its measured pace to fill its minutes), so a
rebuild on other hardware is the same recipe, not the same bytes. Nor quite the same data: the
shipped stages drew narrower `add` operands before decoder-5, no long `sort` strings before
base-5 and decoder-13, and no few-letter `sort` strings before base-7 and decoder-20, while a
rebuild draws the train split of `tasks.py` as it is in every stage.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BASE = "stateblock.train.base_ddp"
READOUT = "stateblock.train.readout_ddp"
# the shipped decoder: rotary positions, row attention, one refinement pass (docs/QUALITY.md)
DECODER_CONFIG = {"d_r": 256, "n_latent": 64, "n_heads": 8, "n_mixer": 2, "mlp_ratio": 3,
                  "row_attn": True, "refine": 1, "rope": True}  # fmt: skip


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    line: str  # the trainer's options, as typed on a command line
    why: str

    @property
    def args(self) -> list[str]:
        return shlex.split(self.line)


def _arg(value) -> str:
    """A JSON option value as one shell word."""
    return shlex.quote(json.dumps(value, separators=(",", ":")))


_DEC = _arg(DECODER_CONFIG)
_BATCH = "--reschedule --warmup 100 --max-batch 1024"
_WEAK = _arg({"sort": 3, "recall": 2})
_SORT = _arg({"sort": 4, "copy": 2})
_FINE = "--reschedule --warmup 50 --max-batch 1024 --workers 5"
# the separators after an item one character from the answer's last item weighted
# 3x (the long answers' early stops all followed one)
_NEAR_END = "--near-end-weight 3"


def _weak(minutes: float, workers: int, weights: str = _WEAK, extra: str = "") -> str:
    """Decoder stages 8 on: a short cosine at peak 1e-4, EOS weight 10, sort 3x
    and recall 2x as often unless `weights` says otherwise, then any `extra` options."""
    return (f"--minutes {minutes} --lr 1e-4 --warmup 30 --reschedule --workers {workers} "
            f"--eos-weight 10 --weights {weights} {extra}").rstrip()  # fmt: skip


STAGES: tuple[Stage, ...] = (
    Stage("base-1", BASE, "--minutes 7.3 --lr 2e-3", "every family, uniform"),
    Stage("base-2", BASE, "--minutes 7.6 --lr 1.5e-3 --reschedule --warmup 100",
          "a second cosine: the long families flip late"),
    Stage("base-3", BASE, f"--minutes 8.2 --lr 1e-3 {_BATCH} --weights {_arg({'sort': 2, 'recall': 2})}",
          "the two weakest families twice as often"),
    Stage("base-4", BASE, f"--minutes 6.8 --lr 7e-4 {_BATCH} --weights {_SORT}",
          "sort, still under 0.95, four times as often"),
    # on one H200 beside two decoder arms: each started from the last base's
    # weights with a new optimizer; the train split draws 17-32-letter sort strings half the time
    Stage("base-5", BASE, f"--minutes 6.3 --lr 3e-4 {_FINE} --weights {_SORT}",
          "long sort strings: sort 0.92 -> 0.94 (seed 99), 0.83 -> 0.93 (seed 1234)"),
    Stage("base-6", BASE, f"--minutes 6.3 --lr 2e-4 {_FINE} --weights {_SORT}",
          "again: sort 0.96 / 0.97, every family at or above 0.96"),
    # each beside two other runs, on a train split whose sort strings are a third of the time
    # 2-8 letters long (base 6 is exact on only 0.38 of strings repeating a letter 6x)
    Stage("base-7", BASE, f"--minutes 7.3 --lr 3e-4 {_FINE} --weights {_arg({'sort': 6, 'copy': 2})}",
          "few-letter sort strings: held-out sort 0.978 / 0.966 / 0.976 (seeds 7 / 99 / 1234)"),
    Stage("base-8", BASE, f"--minutes 7.3 --lr 3e-4 {_FINE} --weights {_arg({'sort': 8, 'copy': 2})}",
          "sort 8x: 0.988 / 0.990 / 0.986, sort errors 2.9 % -> 1.2 % of 1,500 prompts"),
    Stage("decoder-1", READOUT, f"--minutes 8.2 --schedule-minutes 21.4 --lr 1e-3 --workers 8 "
          f"--decoder-config {_DEC}", "one warm-up + cosine planned over three runs"),
    Stage("decoder-2", READOUT, "--minutes 8.2 --lr 1e-3 --workers 8", "the same cosine, resumed"),
    Stage("decoder-3", READOUT, "--minutes 7.3 --lr 1e-3 --workers 8 --eos-weight 10",
          "its end, EOS weighted 10x: the long answers' only errors were a missing EOS"),
    Stage("decoder-4", READOUT, "--minutes 4.4 --lr 4e-4 --warmup 50 --reschedule --workers 8 "
          "--eos-weight 10", "a short second cosine with the EOS weight from its start"),
    # stages 5 and 6 shared the GPU with an ablation arm (the stop loss, then EOS weight 30),
    # so they ran at about half this pace; from 5 on, adds draw full-width operands more often
    Stage("decoder-5", READOUT, "--minutes 6.0 --lr 3e-4 --warmup 50 --reschedule --workers 7 "
          "--eos-weight 10", "a third cosine, EOS weight 10: every long bucket moved"),
    Stage("decoder-6", READOUT, "--minutes 7.6 --lr 3e-4 --warmup 50 --reschedule --workers 7 "
          "--eos-weight 10", "a fourth: 65-256 reached 1.00, long buckets 0.88-0.91"),
    Stage("decoder-7", READOUT, "--minutes 5.0 --lr 2e-4 --warmup 30 --reschedule --workers 14 "
          "--eos-weight 10", "a fifth, lower peak, alone on the GPU"),
    # stage 8 started from stage 7's weights with a new optimizer (--init) beside
    # an ablation arm (refine 2), so at half this pace; 9 and 10 resumed it alone
    Stage("decoder-8", READOUT, _weak(7.2, 7), "sort 3x and recall 2x as often: 1-64's weak two"),
    Stage("decoder-9", READOUT, _weak(7.4, 14), "the same weights, a new short cosine"),
    Stage("decoder-10", READOUT, _weak(5.0, 14), "again: sort was still climbing (0.64 -> 0.68)"),
    # each from the previous stage's weights (--init, a new optimizer) beside ablation arms
    # on the same GPU (their trainer host-bound: 20-30 % GPU a run)
    Stage("decoder-11", READOUT, _weak(7.0, 7), "the same weights: sort 0.68 -> 0.72, 1-64 0.91"),
    Stage("decoder-12", READOUT, _weak(8.0, 4), "and once more: sort 0.84, 1-64 0.94 (trainer)"),
    # stage 13 ran on base 4, 14 on base 5 and 15 on base 6, each from the last stage's
    # weights (--init: a decoder of the previous base is a start); 13 and 14 beside two other
    # runs. From 14 on, cuDNN attention off: 2.6x the steps a second
    Stage("decoder-13", READOUT, _weak(7.3, 5), "long sort strings half the time: sort 0.80 (trainer)"),
    Stage("decoder-14", READOUT, _weak(7.3, 5), "on base 5 (2,601 steps): 1-64 0.975, sort 1.00"),
    Stage("decoder-15", READOUT, _weak(4.6, 12), "on base 6, alone (3,143 steps): 1-64 0.966, sort 0.97"),
    # each beside two other arms on one H200 (about 2,200 steps a run)
    Stage("decoder-16", READOUT, _weak(7.8, 5, extra=_NEAR_END),
          "near-end separators 3x: 1-64 0.983, EOS agreement 1.00 but the teacher's runaway"),
    Stage("decoder-17", READOUT, _weak(7.8, 5, _arg({"sort": 3, "recall": 4}), _NEAR_END),
          "recall 4x: 1-64 0.992 (seed 1234), 0.983 (seed 7), every family >= 0.967"),
    # beside two other arms on one H200 (2,394 steps), picked on seeds 7 and 99
    Stage("decoder-18", READOUT, _weak(7.8, 5, _arg({"sort": 5, "recall": 6}), _NEAR_END),
          "sort 5x, recall 6x: seed 7 at 100 a family 15 misses -> 10, sort 0.91 -> 0.95"),
    # beside two other arms on one H200 (2,388 steps), picked on seeds 7 and 99
    Stage("decoder-19", READOUT, _weak(7.8, 5, _arg({"sort": 7, "recall": 7}), _NEAR_END),
          "sort 7x, recall 7x: at 100 a family seed 7 10 misses -> 8, seed 99 16 -> 13"),
    # each beside two other arms on one H200, on the few-letter train split: 20 on
    # base 6, 21 on base 7, 22 on base 8 (the shipped one), picked on seeds 7 and 99
    Stage("decoder-20", READOUT, _weak(7.6, 5, _arg({"sort": 7, "recall": 7}), _NEAR_END),
          "few-letter sort strings, on base 6 (2,283 steps): seed 7 9 misses, level"),
    Stage("decoder-21", READOUT, _weak(7.6, 5, _arg({"sort": 7, "recall": 7}), _NEAR_END),
          "on base 7 (2,246 steps): 12 misses, 7 of them the teacher's own"),
    Stage("decoder-22", READOUT, _weak(7.6, 5, _arg({"sort": 7, "recall": 9}), _NEAR_END),
          "on base 8, recall 9x (2,603 steps): seed 7 9 misses against E1's 13 at recall 7x"),
    # each beside two other arms on one H200, picked at 100 a family on seeds
    # 7, 99, 1234 and 5: 23 from stage 22, 24 (the shipped one) from 23
    Stage("decoder-23", READOUT, _weak(5.5, 5, _arg({"sort": 9, "recall": 9, "alpha": 2, "copy": 2}), _NEAR_END),
          "alpha and copy 2x, sort 9x (1,726 steps): 37 misses -> 27 over four seeds"),
    Stage("decoder-24", READOUT, _weak(5.5, 5, _arg({"sort": 9, "recall": 12, "alpha": 3, "copy": 2}), _NEAR_END),
          "recall 12x, alpha 3x (1,665 steps): 27 -> 24, every target met on the four seeds"),
)  # fmt: skip


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def smoke_args(module: str, steps: int) -> list[str]:
    """A smoke run's caps: `steps` steps a stage, small batches, no loader processes and no
    held-out report (what a test can afford on two CPU cores)."""
    caps = ["--max-steps", str(steps), "--eval-each", "0", "--workers", "0",
            "--budget", "4096", "--max-batch", "16", "--pool", "64"]  # fmt: skip
    return caps + (["--final-eval-each", "0"] if module == BASE else [])


def command(stage: Stage, work: Path, base_dir: Path, ngpu: int, smoke: int = 0) -> list[str]:
    """The stage's command line: torchrun over `ngpu` GPUs, or one CPU process."""
    if stage.module == BASE:
        where = ["--out", str(work / "base-run"), "--state", str(work / "base-state.pt")]
    else:
        where = ["--base", str(base_dir), "--out", str(work / "decoder-run")]
    extra = smoke_args(stage.module, smoke) if smoke else []
    return launcher(stage.module, ngpu, [*where, *stage.args], extra)


def launcher(module: str, ngpu: int, args: list[str], extra=()) -> list[str]:
    """A trainer's command line: torchrun (DDP) over `ngpu` GPUs, or one CPU process."""
    if ngpu:
        return ["torchrun", "--standalone", f"--nproc_per_node={ngpu}", "-m", module, *args, *extra]
    return [sys.executable, "-m", module, *args, "--device", "cpu", *extra]


def plan(out: Path, work: Path, which: str, start: int, ngpu: int, smoke: int = 0):
    """Every command `build` runs, in order (what --dry-run prints)."""
    stages = [s for s in STAGES if which == "all" or s.name.startswith(which)]
    if not 1 <= start <= len(stages):
        raise ValueError(f"--start must be 1 to {len(stages)} for {which!r}")
    base_dir = out / "base" if which == "decoder" else work / "base-run" / "base"
    return [command(s, work, base_dir, ngpu, smoke) for s in stages[start - 1 :]]


def build(out: Path, work: Path, which: str = "all", start: int = 1, smoke: int = 0) -> None:
    """Run the stages (from the `start`-th of the chosen ones), then copy the results into
    `out` (base/ after the base stages, decoder/ after the decoder's)."""
    ngpu = gpu_count()
    work.mkdir(parents=True, exist_ok=True)
    for cmd in plan(out, work, which, start, ngpu, smoke):
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    if which in ("all", "base"):
        _replace(work / "base-run" / "base", out / "base")
    if which in ("all", "decoder"):
        _replace(work / "decoder-run" / "decoder", out / "decoder")


def _replace(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: the stage left no model there")
    tmp = dst.with_name(dst.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


# The prose base (issue 41, docs/CORPUS.md): a Llama of 26.7 M parameters (12.6 M of them
# the untied embeddings of 16,384 tokens) for the corpus's 11 M train tokens (19.65 M since),
# and a tiny one (0.2 M at 1,024 tokens) that a CPU test trains in seconds on the sample.
PROSE_BASE = ("--dim 384 --mlp-dim 1536 --n-layers 6 --n-heads 6 --seq-len 512 --budget 65536 "
              "--lr 1e-3 --warmup 200")  # fmt: skip
PROSE_TINY = ("--dim 64 --mlp-dim 128 --n-layers 2 --n-heads 4 --seq-len 32 --budget 512 "
              "--lr 5e-3 --warmup 5")  # fmt: skip


def prose_base(corpus: Path, tokenizer: Path, work: Path, ngpu: int, minutes: float,
               tiny: bool = False) -> list[str]:  # fmt: skip
    """A prose base stage's command line: resumable from WORK/prose-base-state.pt, the model
    in WORK/prose-base-run/base."""
    args = ["--corpus", str(corpus), "--tokenizer", str(tokenizer), "--minutes", str(minutes),
            "--out", str(work / "prose-base-run"), "--state", str(work / "prose-base-state.pt"),
            *shlex.split(PROSE_TINY if tiny else PROSE_BASE)]  # fmt: skip
    return launcher(BASE, ngpu, args)
