"""The prose pair built by one command (issue 41): tasks -> base -> tuned base -> teacher ->
readout -> evaluation, each stage skipped when its output exists (a stage writes its output
last, whole), so a build that stopped resumes where it stopped.

    python -m stateblock.train.prose_readout --corpus data/prose --work runs/prose \\
        --out models/prose [--scale bench] [--tokenizer DIR] [--base DIR | --base-weights P]

`stateblock build-reference --recipe prose` runs the same. WORK holds every stage's output:

    tokenizer/         the BPE (`prose_tokenizer`), unless --tokenizer or a base is given
    prose-base-run/    the document-trained base (`base_ddp --corpus`), unless --base or
                       --base-weights (a `prose_stage` checkpoint prefix) gives one
    tasks/             train.jsonl.gz, heldout.jsonl.gz (`prose_tasks`): the train prompts
                       tune the base (all of them) and train the readout (the first
                       train_prompts); a split file found is kept
    tuned/             the base tuned on the tasks (`prose_tune`): the served base
    teacher/           train.jsonl, heldout.jsonl: the tuned base's greedy answers
    decoder/           the readout distilled on the train teacher (`distill.fit`)
    summary.json, summary.md   the base vs truth and the readout vs teacher, held out
    readouts.jsonl     the readout's answer ids to each held-out prompt, in teacher order

OUT/base and OUT/decoder are then the pair `stateblock up --base OUT/base --decoder
OUT/decoder` serves. A scale (`SCALES`) sets every size; `tiny` is the CPU test's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from stateblock.model.copy_head import MODES as COPY_MODES
from stateblock.train import prose_fidelity, prose_tasks, prose_tokenizer, prose_tune, recipe
from stateblock.train.corpus import read_documents
from stateblock.train.distill import DistillConfig
from stateblock.train.prose_tune import TuneConfig


@dataclass(frozen=True)
class Scale:
    base_args: str  # base_ddp's shape and batch (recipe.PROSE_TINY or PROSE_BASE)
    base_minutes: float
    base_max_steps: int  # 0: as many as the minutes hold
    vocab_size: int  # the BPE built when no tokenizer is given
    train_prompts: int  # the teacher answers these, the readout trains on them
    heldout_prompts: int
    max_answer: int  # the teacher's cap and the decoder's served depth
    tune: TuneConfig
    distill: DistillConfig
    teacher_budget: int = 65536  # tokens a verifying forward
    weights: dict = field(default_factory=dict)  # prose_tasks family weights
    # the base is tuned on these many train prompts, the first train_prompts of them the
    # teacher's (0: train_prompts). More than tuning's budget reads once, none is seen
    # twice: a tuning that reads its prompts several times learns them rather than the
    # tasks (docs/QUALITY.md)
    tune_prompts: int = 0

    @property
    def train_examples(self) -> int:
        """The train prompts the tasks stage writes: the tuning's and the teacher's."""
        return max(self.train_prompts, self.tune_prompts)


# the readout's shape: recipe.DECODER_CONFIG (the shipped synthetic decoder's); at the bench
# scale with the copy head the ablations made best (docs/QUALITY.md; `--copy none`: without)
PROSE_COPY = {"copy": "twin", "copy_guess": 4, "copy_follow": True, "copy_span": True,
              "copy_match": 16, "copy_match_ends": True}  # fmt: skip
SCALES = {
    "tiny": Scale(recipe.PROSE_TINY, 5.0, 200, 1024, 1200, 60, 24,
                  TuneConfig(steps=200, token_budget=3072, lr=3e-3, warmup=10),
                  DistillConfig(steps=300, token_budget=384, max_lanes=16, lr=3e-3, warmup=10,
                                max_answer=24, eos_weight=3.0, ckpt_every=100,
                                decoder={"d_r": 48, "n_latent": 8, "n_heads": 4, "n_mixer": 1,
                                         "row_attn": True, "rope": True, "mlp_ratio": 2}),
                  teacher_budget=8192),
    "bench": Scale(recipe.PROSE_BASE, 8.0, 0, prose_tokenizer.VOCAB_SIZE, 20000, 1000, 256,
                   TuneConfig(steps=3000, token_budget=65536, lr=3e-4, warmup=100,
                              max_minutes=1.5),
                   DistillConfig(steps=6000, token_budget=49152, lr=1e-3, warmup=200,
                                 max_answer=256, eos_weight=10.0, max_minutes=3.0,
                                 decoder={**recipe.DECODER_CONFIG, **PROSE_COPY}),
                   weights={"continue": 2.5}),  # 2.5x draws, as they fail more often: a fifth
}  # fmt: skip


def log(*parts) -> None:
    print("[prose]", *parts, flush=True)


def need_corpus(a, stage: str) -> None:
    if not a.corpus:
        raise SystemExit(f"--corpus is needed to build {stage} (its output is not in --work)")


def stage_tokenizer(a, work: Path, scale: Scale) -> Path:
    if a.tokenizer:
        return Path(a.tokenizer)
    out = work / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        need_corpus(a, "a tokenizer")
        log("tokenizer: a BPE of", scale.vocab_size, "tokens on", a.corpus)
        texts = read_documents(Path(a.corpus) / "train.txt")
        prose_tokenizer.save_bpe(prose_tokenizer.train_bpe(texts, scale.vocab_size), out)
    return out


def stage_base(a, work: Path, scale: Scale) -> Path:
    """The document-trained base: --base, or --base-weights made a base directory, or a
    base_ddp run on the corpus (its own state file resumes it)."""
    if a.base:
        return Path(a.base)
    out = work / "prose-base-run" / "base"
    if (out / "model.safetensors").is_file():
        return out
    tok = stage_tokenizer(a, work, scale)
    if a.base_weights:
        log("base: from the stage weights", a.base_weights)
        from_stage_weights(Path(a.base_weights), tok, out, a.base_shape or scale.base_args)
        return out
    need_corpus(a, "the base")
    cmd = recipe.prose_base(Path(a.corpus), tok, work, 0 if a.device == "cpu" else 1,
                            scale.base_minutes, tiny=scale.base_args == recipe.PROSE_TINY)  # fmt: skip
    extra = ["--workers", "0", "--eval-tokens", "65536"]
    if scale.base_max_steps:
        extra += ["--max-steps", str(scale.base_max_steps)]
    log("base:", " ".join(cmd + extra))
    subprocess.run(cmd + extra, check=True)
    return out


def from_stage_weights(prefix: Path, tok_dir: Path, out: Path, shape_args: str) -> None:
    """A base directory from a `prose_stage` checkpoint (bf16 parts at `prefix`) and its
    tokenizer, in the shape base_ddp's `shape_args` give."""
    import torch
    from transformers import AutoTokenizer

    from stateblock.train import base_ddp, prose_data
    from stateblock.train.weights import init_weights

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    shape = base_ddp.parse_args(["--out", "-", "--corpus", "-", "--tokenizer", "-",
                                 *shape_args.split()])  # fmt: skip
    model = base_ddp.build_model(tok, shape)
    model.load_state_dict({k: v.float() for k, v in init_weights(prefix).items()})
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
    prose_data.copy_tokenizer(tok_dir, tmp)
    tmp.rename(out)


def tuned_done(work: Path) -> bool:
    return (work / "tuned" / "model.safetensors").is_file()


def teacher_done(work: Path) -> bool:
    return (work / "teacher" / "heldout.jsonl").is_file()


def stage_tasks(a, work: Path, scale: Scale) -> Path:
    """Each split's prompts, unless its file is there already (a GPU call carries the
    held-out prompts of earlier arms and makes the train prompts from the corpus)."""
    out = work / "tasks"
    if tuned_done(work) and teacher_done(work):
        return out  # what reads the prompts is done (a call that distils alone)
    for split, n, seed in (("train", scale.train_examples, a.seed),
                           ("heldout", scale.heldout_prompts, a.seed + 1)):  # fmt: skip
        path = out / f"{split}.jsonl.gz"
        if path.is_file():
            continue
        need_corpus(a, f"the {split} tasks")
        t0 = time.perf_counter()
        exs = prose_tasks.from_corpus(a.corpus, split, n, seed, scale.weights, a.task_workers)
        tmp = path.with_name(f"{split}.tmp.jsonl.gz")
        prose_tasks.write(exs, tmp)
        tmp.rename(path)
        log(f"tasks: {len(exs)} {split} prompts in {time.perf_counter() - t0:.1f} s")
    return out


def train_tasks(tasks: Path, n: int) -> list[prose_tasks.Example]:
    """The first n train prompts; SystemExit when the file holds fewer (an arm asking for
    more than the tasks an earlier one wrote: remove the file to make them)."""
    examples = prose_tasks.read(tasks / "train.jsonl.gz")
    if len(examples) < n:
        raise SystemExit(f"{tasks / 'train.jsonl.gz'} holds {len(examples)} prompts, the "
                         f"scale asks for {n}: remove it to make them (needs --corpus)")  # fmt: skip
    return examples[:n]


def stage_tune(a, work: Path, scale: Scale, base: Path | None, tasks: Path) -> Path | None:
    """The tuned base; None where `--tune-call-minutes` stopped the tuning first (its state
    left in WORK/tuned.resume.pt for the next run)."""
    out = work / "tuned"
    if not tuned_done(work):
        examples = train_tasks(tasks, scale.train_examples)
        stats = prose_tune.tune(base, examples, out, replace(scale.tune, seed=a.seed), a.device)
        log("tune:", json.dumps({k: v for k, v in stats.items() if k != "config"}))
        if not stats["finished"]:
            return None
    return out


def stage_teacher(a, work: Path, scale: Scale, tuned: Path, tasks: Path) -> Path:
    from stateblock.model.loading import load_base

    out = work / "teacher"
    if teacher_done(work):
        return out
    model, tok = load_base(tuned, a.device)
    tmp = out.with_name("teacher.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        t0 = time.perf_counter()
        exs = (train_tasks(tasks, scale.train_prompts) if split == "train"
               else prose_tasks.read(tasks / "heldout.jsonl.gz"))  # fmt: skip
        recs = prose_fidelity.teacher_records(model, tok, exs, scale.max_answer, a.device,
                                              scale.teacher_budget)  # fmt: skip
        (tmp / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        log(f"teacher: {len(recs)} {split} answers in {time.perf_counter() - t0:.1f} s")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def stage_distil(a, work: Path, scale: Scale, tuned: Path, teacher: Path) -> Path:
    from stateblock.model import checkpoint as ckpt
    from stateblock.model.capture import lm_head_weight
    from stateblock.model.loading import load_base
    from stateblock.train import distill

    out = work / "decoder"
    if (out / "manifest.json").is_file():
        return out
    base, tok = load_base(tuned, a.device)
    identity = distill.base_identity(tuned, lm_head_weight(base))
    identity["data_digest"] = ckpt.sha_files([teacher / "train.jsonl"])
    stats = distill.fit(base, tok, read_records(teacher / "train.jsonl"), identity, out,
                        distill_config(a, scale), a.device)  # fmt: skip
    log("distil:", json.dumps(stats))
    return out


def distill_config(a, scale: Scale) -> DistillConfig:
    """The scale's distillation; the readout's copy head and row tokens as the flags say
    when they say anything (`--copy none`: no copy head), else the scale's."""
    cfg = replace(scale.distill, seed=a.seed)
    if not (a.copy or a.row_tokens):
        return cfg
    ids = {"copy": "" if a.copy == "none" else a.copy, "row_tokens": a.row_tokens,
           "copy_guess": a.copy_guess, "copy_follow": a.copy_follow, "copy_span": a.copy_span,
           "copy_match": a.copy_match, "copy_match_ends": a.copy_match_ends,
           "copy_point": -1 if a.copy_point else 0}  # fmt: skip
    return replace(cfg, decoder={**cfg.decoder, **ids})


def stage_eval(a, work: Path, scale: Scale, tuned: Path, teacher: Path, decoder: Path) -> dict:
    from stateblock.model.capture import lm_head_weight
    from stateblock.model.checkpoint import load_decoder
    from stateblock.model.loading import load_base

    path = work / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    base, tok = load_base(tuned, a.device)
    dec, _ = load_decoder(decoder, base_dir=tuned, lm_head=lm_head_weight(base))
    dec = dec.to(a.device).eval()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    held = read_records(teacher / "heldout.jsonl")
    summary = {"scale": a.scale, "max_answer": scale.max_answer,
               "base": prose_fidelity.base_report(held, eos),
               "base_train_split": prose_fidelity.base_report(
                   read_records(teacher / "train.jsonl"), eos),
               "readout": prose_fidelity.fidelity(base, dec, held, scale.max_answer, eos, pad,
                                                  a.device)}  # fmt: skip
    tuned_stats = tuned / "tune_stats.json"
    if tuned_stats.is_file():
        summary["tune"] = json.loads(tuned_stats.read_text())
    summary["decoder"] = json.loads((decoder / "manifest.json").read_text()).get("training")
    readouts = summary["readout"].pop("readouts")
    (work / "readouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in readouts))
    (work / "summary.md").write_text(prose_fidelity.markdown(summary))
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def timed(name: str, stage, *args):
    """A stage's result, its wall time logged (a skipped stage takes about none)."""
    t = time.perf_counter()
    out = stage(*args)
    log(f"stage {name}: {time.perf_counter() - t:.1f} s")
    return out


def with_overrides(scale: Scale, a: argparse.Namespace) -> Scale:
    """The scale with the sizes given on the command line (an ablation's arm)."""
    if a.train_prompts:
        scale = replace(scale, train_prompts=a.train_prompts)
    if a.tune_prompts:
        scale = replace(scale, tune_prompts=a.tune_prompts)
    if a.tune_minutes:
        scale = replace(scale, tune=replace(scale.tune, max_minutes=a.tune_minutes))
    if a.tune_steps:
        scale = replace(scale, tune=replace(scale.tune, steps=a.tune_steps))
    if a.tune_call_minutes:
        scale = replace(scale, tune=replace(scale.tune, call_minutes=a.tune_call_minutes))
    if a.distill_minutes:
        scale = replace(scale, distill=replace(scale.distill, max_minutes=a.distill_minutes))
    if a.distill_init:
        scale = replace(scale, distill=replace(scale.distill, init=a.distill_init))
    if a.distill_lr:
        scale = replace(scale, distill=replace(scale.distill, lr=a.distill_lr))
    if a.bonus_lr:
        scale = replace(scale, distill=replace(scale.distill, bonus_lr=a.bonus_lr))
    return scale


def build(a: argparse.Namespace) -> dict:
    """Every stage in order; then the pair into a.out (when given)."""
    scale = with_overrides(SCALES[a.scale], a)
    if a.base and (a.tokenizer or a.base_weights):
        raise ValueError("--base carries its own tokenizer and weights: give it alone")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tasks = timed("tasks", stage_tasks, a, work, scale)
    if a.until == "tasks":
        return {}
    base = None if tuned_done(work) else timed("base", stage_base, a, work, scale)  # what tunes
    tuned = timed("tune", stage_tune, a, work, scale, base, tasks)
    if tuned is None:
        log("tuning stopped for this run; run again to go on from", prose_tune.resume_path(
            work / "tuned"))  # fmt: skip
        return {}
    teacher = timed("teacher", stage_teacher, a, work, scale, tuned, tasks)
    decoder = timed("distil", stage_distil, a, work, scale, tuned, teacher)
    summary = timed("eval", stage_eval, a, work, scale, tuned, teacher, decoder)
    if a.out:
        for name, src in (("base", tuned), ("decoder", decoder)):
            recipe._replace(src, Path(a.out) / name)
    log(f"done in {time.perf_counter() - t0:.1f} s; {work / 'summary.md'}")
    return summary


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m stateblock.train.prose_readout",
                                 description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add = ap.add_argument
    add("--corpus", default="",
        help="a corpus directory: train.txt and heldout.txt (for the stages that read it)")  # fmt: skip
    add("--work", default="runs/prose", help="every stage's output (a stage found is skipped)")
    add("--out", default="", help="where the pair goes: OUT/base and OUT/decoder")
    add("--scale", choices=sorted(SCALES), default="bench", help="the sizes of every stage")
    add("--tokenizer", default="", help="the BPE directory (default: one built in WORK)")
    add("--base", default="", help="a document-trained base directory (skips the base stage)")
    add("--base-weights", default="",
        help="a prose_stage checkpoint prefix (DIR/base): the base, in the scale's shape")  # fmt: skip
    add("--base-shape", default="",
        help="base_ddp's shape arguments of --base-weights where not the scale's, e.g. "
             "'--dim 512 --n-layers 10 --mlp-dim 2048 --n-heads 8'")  # fmt: skip
    add("--device", default="cpu", help="cpu or cuda")
    add("--seed", type=int, default=0, help="tasks, tuning and the readout's seed")
    add("--train-prompts", type=int, default=0,
        help="the teacher's and the readout's train prompts (0: the scale's)")  # fmt: skip
    add("--tune-prompts", type=int, default=0,
        help="the tuning's train prompts, a superset of those (0: the scale's)")  # fmt: skip
    add("--task-workers", type=int, default=1,
        help="processes making the tasks (more than one: generate_sharded's prompts)")  # fmt: skip
    add("--tune-minutes", type=float, default=0.0, help="tuning's budget (0: the scale's)")
    add("--tune-call-minutes", type=float, default=0.0,
        help="this run tunes at most this long, then leaves the tuning's state in "
             "WORK/tuned.resume.pt and stops; the next run goes on from it (a tuning longer than "
             "one device call: --tune-minutes is then the whole tuning's budget)")  # fmt: skip
    add("--tune-steps", type=int, default=0,
        help="tuning's steps at most (0: the scale's; the minutes may stop it sooner)")  # fmt: skip
    add("--distill-minutes", type=float, default=0.0, help="the readout's (0: the scale's)")
    add("--distill-init", default="",
        help="a finished decoder of this pair to go on training (another call's)")  # fmt: skip
    add("--distill-lr", type=float, default=0.0,
        help="the readout's peak learning rate (0: the scale's; a run from --distill-init may "
             "want less: a fresh optimizer at the full rate can diverge)")  # fmt: skip
    add("--bonus-lr", type=float, default=0.0,
        help="the copy head's bonuses learn at this multiple of the rate (0: DistillConfig's)")  # fmt: skip
    add("--copy", choices=("", "none", *COPY_MODES), default="",
        help="the readout's copy head (stateblock.model.copy_head) with the --copy-* options "
             "given, or none; default: the scale's (bench: PROSE_COPY, tiny: none)")  # fmt: skip
    add("--copy-guess", type=int, default=0,
        help="with --copy: the base's top-N first tokens join the copy head's candidates")  # fmt: skip
    add("--copy-follow", action="store_true",
        help="with --copy: the refinement's copy scores follow the previous pass's tokens")  # fmt: skip
    add("--copy-span", action="store_true",
        help="with --copy: the refinement's copy scores take the previous pass's vote on "
             "where a copied span starts")  # fmt: skip
    add("--copy-match", type=int, default=0,
        help="with --copy: copy scores gain a bonus by how long a run of tokens before a "
             "span's start repeats in the prompt (runs up to N counted)")  # fmt: skip
    add("--copy-match-ends", action="store_true",
        help="with --copy-match: runs that stop before a span's start get bonuses of their own")  # fmt: skip
    add("--copy-point", action="store_true",
        help="with --copy: copy scores gain a learned mix of the base's attention from the "
             "prompt's last position, every head (ReadoutConfig.copy_point)")  # fmt: skip
    add("--row-tokens", action="store_true",
        help="the readout's rows also carry their own tokens (ReadoutConfig.row_tokens)")  # fmt: skip
    add("--until", choices=("tasks", "all"), default="all",
        help="tasks: write WORK/tasks and stop (what a GPU call carries)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    summary = build(a)
    if not summary:
        return 0
    print(
        json.dumps(
            {k: summary[k] for k in ("base",)}
            | {"readout": {k: v for k, v in summary["readout"].items() if k != "readouts"}},
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
