"""The prose base tuned on the prose tasks (`prose_tasks.py`): a base trained on documents has
never seen a prompt framed `<bos> ... <ans>`, so it learns here to answer one, with the
answer and then `<eos>`: the truth of the determined tasks, the text's own next sentence for
a continuation. The loss is over the answer and its `<eos>` only; the rest of the recipe is
the base trainers' (AdamW, a warm-up and a cosine, bf16 autocast on the GPU).

The result is a base directory in the `from_pretrained` layout (bf16 weights and the
tokenizer), what the teacher, the readout and `stateblock up --base` load.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stateblock.model.loading import load_base
from stateblock.train import prose_data, prose_tasks
from stateblock.train.batching import budget_batches
from stateblock.train.reference import StepPlan, lr_at
from stateblock.train.weights import read_state, restore, save_state


@dataclass(frozen=True)
class TuneConfig:
    steps: int = 2000
    token_budget: int = 32768  # padded tokens a batch
    max_lanes: int = 256
    lr: float = 3e-4
    warmup: int = 50
    seed: int = 0
    max_minutes: float = 0.0  # >0: the step count shrinks to fit (decided at step 30)
    # >0: this run stops after this long and leaves its state beside `out` (`resume_path`);
    # the next run goes on from it to the same step count, batch for batch
    call_minutes: float = 0.0


def encode(tok, examples: list[prose_tasks.Example]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids `<bos> ... <ans>`, answer ids + `<eos>`) per example."""
    prompts = tok([e.prompt for e in examples])["input_ids"]
    answers = tok([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    return [(p, [*a, tok.eos_token_id]) for p, a in zip(prompts, answers, strict=True)]


def batch_of(pairs, idx: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of one batch, right-padded; labels the next token on answer positions."""
    width = max(len(pairs[i][0]) + len(pairs[i][1]) for i in idx)
    ids = torch.full((len(idx), width), pad, dtype=torch.long)
    lab = torch.full((len(idx), width), -100, dtype=torch.long)
    for r, i in enumerate(idx):
        p, a = pairs[i]
        ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        lab[r, len(p) - 1 : len(p) + len(a) - 1] = torch.tensor(a)
    return ids, lab


def resume_path(out: Path) -> Path:
    """Where a tuning stopped by `call_minutes` leaves its state: weights, optimizer, step."""
    return out.with_name(out.name + ".resume.pt")


def tune(base_dir: Path, examples: list[prose_tasks.Example], out: Path, cfg: TuneConfig,
         device: str = "cpu", clock=time.perf_counter) -> dict:  # fmt: skip
    """Fine-tune the base at base_dir on `examples`; the tuned base goes to out. A run that
    `cfg.call_minutes` stops first leaves its state in resume_path(out) (stats' `finished`
    False), and the next run with the same examples and config goes on from it."""
    model, tok = load_base(base_dir, device)
    model.train().requires_grad_(True)
    pairs = encode(tok, examples)
    lengths = [len(p) + len(a) for p, a in pairs]
    batches = budget_batches(lengths, cfg.token_budget, max_batch=cfg.max_lanes, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    state = _resume(resume_path(out), model, opt, device)
    step, steps, losses = state["step"], state["steps"] or cfg.steps, state["losses"]
    t0 = clock()
    plan = StepPlan(steps, 30, cfg.max_minutes, start=step, clock=clock)
    while step < steps:
        if cfg.call_minutes and clock() - t0 >= 60 * cfg.call_minutes:
            save_state(
                resume_path(out),
                {"model": model, "opt": opt},
                step=step,
                steps=steps,
                losses=losses,
            )
            return {"finished": False, "step": step, "steps": steps, "device": device}
        steps = plan.plan(step)
        ids, lab = (t.to(device) for t in batch_of(pairs, batches[step % len(batches)],
                                                     tok.pad_token_id))  # fmt: skip
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, cfg.lr, cfg.warmup)
        with amp:
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
    stats = {"finished": True, "steps": steps, "seconds": round(clock() - t0, 1),
             "resumed_at": state["step"], "examples": len(examples),
             "first_loss": round(losses[0], 4),
             "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
             "config": asdict(cfg), "device": device}  # fmt: skip
    save(model, base_dir, out)
    (out / "tune_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    resume_path(out).unlink(missing_ok=True)
    return stats


def _resume(where: Path, model, opt, device: str) -> dict:
    """A stopped run's step, step count and losses, its weights and optimizer loaded; a
    fresh run's zeros."""
    saved = read_state(where, device)
    if saved is None:
        return {"step": 0, "steps": 0, "losses": []}
    return restore(saved, {"model": model, "opt": opt})


def save(model, base_dir: Path, out: Path) -> None:
    """The tuned weights in bf16 and the base's tokenizer, written beside and renamed into
    place, so `out` is either absent or whole."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
    prose_data.copy_tokenizer(base_dir, tmp)
    tmp.rename(out)
