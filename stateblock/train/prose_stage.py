"""One GPU stage of the prose base (issue 41, docs/CORPUS.md): `recipe.PROSE_BASE` trained on
the uint16 shards of `prose_shards.py` within a wall-clock budget, on one device.

    python -m stateblock.train.prose_stage --data .gpu_prose --out OUT [--minutes 6.5]
        [--epochs 4,12,30] [--init OUT/base] [--compile auto|on|off] [--device cuda|cpu]

The train split (19.65 M tokens) is small beside what a GPU does in minutes, so the stage
runs arms: each starts from the same weights (a fresh init, or `--init`), has a warm-up and a
cosine over its number of passes over the train split (capped by its share of the budget)
and is scored on the whole held-out split at every half pass; the best weights of any arm
are the stage's result. Batches are random windows of the train stream, drawn on the device
(nanoGPT's `get_batch`); bf16 autocast, fused AdamW. With `--compile auto` a probe times
eager and `torch.compile`d steps and keeps the faster (the probe's updates are undone).

OUT gets summary.json and summary.md after every arm, and the best weights in bf16 as
OUT/base.part<N>.safetensors (parts of at most 15 MiB) unless they exceed
`--max-checkpoint-mb`; `--init OUT/base` starts a later stage from them (fresh optimizer).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stateblock.train import base_ddp, prose_eval, prose_shards, recipe
from stateblock.train.prose_report import markdown
from stateblock.train.prose_shards import SPLITS
from stateblock.train.weights import init_weights, save_split

PART_BYTES = 15 * 2**20  # a device call returns files of at most 16 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m stateblock.train.prose_stage",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = ap.add_argument
    add("--data", required=True, help="the folder prose_shards wrote")
    add("--out", required=True, help="summary.json, summary.md and the weights' parts")
    add("--minutes", type=float, default=6.5, help="wall budget from start to the last arm's end")
    add("--epochs", default="4,12,30", help="the arms, in order: passes over the train split")
    add("--init", default="", help="every arm starts from these weights (OUT/base or a base dir)")
    add("--device", default="cuda", help="cuda or cpu")
    add("--compile", choices=("auto", "on", "off"), default="auto",
        help="torch.compile the step: auto keeps it where the probe finds it faster")  # fmt: skip
    base_ddp.add_shape_args(ap)
    add("--seq-len", type=int, help="tokens a training window")
    add("--budget", type=int, help="tokens a batch (windows of --seq-len)")
    add("--lr", type=float, help="peak learning rate of every arm")
    add("--warmup", type=int, help="warm-up steps (at most a tenth of an arm)")
    add("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices only")
    add("--evals-per-epoch", type=float, default=2.0, help="held-out scores a pass")
    add("--samples", type=int, default=16, help="held-out passages continued greedily")
    add("--max-checkpoint-mb", type=float, default=60.0, help="larger bf16 weights are not saved")
    add("--seed", type=int, default=0, help="random seed (init and windows)")
    # recipe.PROSE_BASE gives the shape, batch, lr and warm-up; options typed after override it
    a = ap.parse_args([*shlex.split(recipe.PROSE_BASE), *(sys.argv[1:] if argv is None else argv)])
    try:
        a.arms = [float(e) for e in a.epochs.split(",")]
    except ValueError:
        ap.error(f"--epochs: comma-separated numbers, not {a.epochs!r}")
    if not a.arms or min(a.arms) <= 0:
        ap.error("--epochs: each arm needs a positive number of passes")
    return a


@dataclass
class Data:
    train: torch.Tensor  # int32 id streams on the device
    heldout: torch.Tensor
    meta: dict

    @classmethod
    def load(cls, folder: Path, device: torch.device) -> Data:
        meta = prose_shards.read_meta(folder)
        train, heldout = (prose_shards.load_split(folder, s).to(device) for s in SPLITS)
        return cls(train, heldout, meta)


class Windows:
    """Endless (ids, labels) batches of random windows of the train stream, on its device."""

    def __init__(self, ids: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        if len(ids) <= seq_len + 1:
            raise ValueError(f"the train split has {len(ids)} tokens, fewer than a window")
        self.ids, self.batch = ids, batch
        self.g = torch.Generator(device=ids.device).manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=ids.device)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = len(self.ids) - len(self.offsets)
        starts = torch.randint(hi, (self.batch, 1), device=self.ids.device, generator=self.g)
        w = self.ids[starts + self.offsets].long()
        return w[:, :-1], w[:, 1:]


def loss_fn(model, compiled: bool):
    """The training loss of a batch: bf16 autocast on the GPU, the logits' loss in fp32."""
    amp = model.device.type == "cuda"

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return torch.compile(loss) if compiled else loss


def optimizer(model, a: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW, decay on matrices (nanoGPT's groups), fused on the GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    fused = model.device.type == "cuda"
    return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), fused=fused)


def step(loss, opt, model, x, y) -> torch.Tensor:
    out = loss(x, y)
    out.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(loss, opt, model, batches: Windows, n: int) -> float:
    """Seconds a step over `n` steps."""
    sync(model.device)
    t = time.perf_counter()
    for _ in range(n):
        step(loss, opt, model, *batches())
    sync(model.device)
    return (time.perf_counter() - t) / n


def choose_step(model, batches: Windows, a: argparse.Namespace) -> tuple:
    """(loss function, seconds a step, what the probe saw). The probe's steps change the
    weights: the caller restores them."""
    opt = optimizer(model, a)
    for g in opt.param_groups:
        g["lr"] = a.lr / 10
    n = 20 if model.device.type == "cuda" else 3
    eager = loss_fn(model, False)
    timed(eager, opt, model, batches, 3)  # warm-up: kernels chosen, memory allocated
    report = {"mode": a.compile, "eager_ms": round(timed(eager, opt, model, batches, n) * 1e3, 2)}
    if a.compile == "off":
        return eager, report["eager_ms"] / 1e3, report
    try:
        compiled = loss_fn(model, True)
        t = time.perf_counter()
        timed(compiled, opt, model, batches, 2)  # compiles forward and backward
        report["compile_s"] = round(time.perf_counter() - t, 1)
        report["compiled_ms"] = round(timed(compiled, opt, model, batches, n) * 1e3, 2)
    except Exception as e:  # any failure to compile leaves the eager step
        report["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return eager, report["eager_ms"] / 1e3, report
    use = a.compile == "on" or report["compiled_ms"] < 0.95 * report["eager_ms"]
    report["used"] = "compiled" if use else "eager"
    if use:
        return compiled, report["compiled_ms"] / 1e3, report
    return eager, report["eager_ms"] / 1e3, report


def flops_per_token(model, seq_len: int) -> float:
    """6 x the matrix parameters (the input embedding is a lookup) + causal attention's."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


@dataclass
class Arm:
    epochs: float
    steps: int  # planned: the cosine's length
    warmup: int
    every: int  # steps between held-out scores


def plan_arm(a, epochs: float, seconds: float, pace: float, tokens: int) -> Arm:
    """An arm's steps: its passes over the train split, or what its share of the budget
    holds at the probe's pace (held-out scoring costs a little on top)."""
    per_epoch = tokens / a.budget
    steps = max(1, min(round(epochs * per_epoch), int(0.9 * seconds / pace)))
    every = max(1, round(per_epoch / a.evals_per_epoch))
    return Arm(epochs, steps, max(1, min(a.warmup, steps // 10)), every)


def lr_at(a, arm: Arm, i: int) -> float:
    """Linear warm-up, then a cosine to a tenth of the peak."""
    if i < arm.warmup:
        return a.lr * (i + 1) / arm.warmup
    frac = (i - arm.warmup) / max(1, arm.steps - arm.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def heldout(model, data: Data, a) -> dict:
    model.eval()
    nll_sum, tokens = prose_eval.score(model, data.heldout, a.seq_len, data.meta["bos"])
    model.train()
    return prose_eval.figures(nll_sum, tokens, data.meta["splits"]["heldout"])


def run_arm(model, loss, batches: Windows, data: Data, a, arm: Arm, deadline: float) -> tuple:
    """Train one arm; returns (its record, its best weights as a state dict copy)."""
    opt = optimizer(model, a)
    model.zero_grad(set_to_none=True)  # nothing left over from the probe or the last arm
    per_epoch = data.meta["splits"]["train"]["tokens"] / a.budget
    curve, best, best_sd = [], None, None
    running, count = torch.zeros((), device=model.device), 0
    t0, i = time.perf_counter(), 0
    while i < arm.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(a, arm, i)
        running += step(loss, opt, model, *batches())
        i, count = i + 1, count + 1
        late = time.perf_counter() > deadline
        if i % arm.every and i < arm.steps and not late:
            continue
        score = heldout(model, data, a)
        curve.append({"step": i, "epoch": round(i / per_epoch, 2), "heldout_nll": score["nll"],
                      "train_nll": round(running.item() / count, 4)})  # fmt: skip
        print(json.dumps({"arm": arm.epochs, **curve[-1]}), flush=True)
        running, count = torch.zeros((), device=model.device), 0
        if best is None or score["nll"] < best["nll"]:
            best = {**score, "step": i, "epoch": curve[-1]["epoch"]}
            best_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if late:
            break
    seconds = time.perf_counter() - t0
    record = {"epochs_planned": arm.epochs, "steps_planned": arm.steps, "steps": i,
              "warmup": arm.warmup, "epochs_done": round(i / per_epoch, 2),
              "stopped_by_clock": i < arm.steps, "seconds": round(seconds, 1),
              "tokens": i * a.budget, "tokens_per_s": round(i * a.budget / seconds),
              "best": best, "curve": curve}  # fmt: skip
    return record, best_sd


def save_checkpoint(sd: dict, out: Path, max_mb: float) -> dict:
    """The weights in bf16 as OUT/base.part<N>.safetensors, or why not."""
    for old in out.glob("base.part*.safetensors"):
        old.unlink()
    bf16 = {k: v.detach().to(torch.bfloat16).cpu() for k, v in sd.items()}
    mb = sum(v.numel() * v.element_size() for v in bf16.values()) / 1e6
    if mb > max_mb:
        return {"saved": False, "mb": round(mb, 1), "why": f"over --max-checkpoint-mb {max_mb}"}
    parts = save_split(bf16, out / "base", max_bytes=PART_BYTES)
    return {"saved": True, "mb": round(mb, 1), "prefix": "base", "parts": parts}


def build(a, data: Data, device: torch.device):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(a.data) / "tokenizer"), local_files_only=True)
    torch.manual_seed(a.seed)
    model = base_ddp.build_model(tok, argparse.Namespace(**vars(a), corpus=a.data))
    if a.init:
        model.load_state_dict(init_weights(Path(a.init)))
    return tok, model.to(device).train()


def write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))


def main(argv: list[str] | None = None) -> dict:
    t_start = time.perf_counter()
    a = parse_args(argv)
    out, device = Path(a.out), torch.device(a.device)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    data = Data.load(Path(a.data), device)
    tok, model = build(a, data, device)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = Windows(data.train, a.seq_len, a.budget // a.seq_len, a.seed)
    loss, pace, probe = choose_step(model, batches, a)
    model.load_state_dict(start)
    summary = header(a, model, data, probe, device)
    summary["start"] = heldout(model, data, a)
    deadline = t_start + a.minutes * 60
    best_nll, best_sd = math.inf, start
    for k, epochs in enumerate(a.arms):
        model.load_state_dict(start)
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        arm = plan_arm(a, epochs, left * epochs / sum(a.arms[k:]), pace, len(data.train))
        batches = Windows(data.train, a.seq_len, a.budget // a.seq_len, a.seed + 1 + k)
        record, sd = run_arm(model, loss, batches, data, a, arm, deadline)
        summary["arms"].append(record)
        if record["best"]["nll"] < best_nll:
            best_nll, best_sd = record["best"]["nll"], sd
            summary["best"] = {"arm": k, **record["best"]}
            summary["checkpoint"] = save_checkpoint(sd, out, a.max_checkpoint_mb)
        summary["seconds"] = round(time.perf_counter() - t_start, 1)
        write_summary(out, summary)
    model.load_state_dict(best_sd)
    bos, eos = data.meta["bos"], data.meta["eos"]
    summary["continuations"] = prose_eval.continuations(
        model, data.heldout, bos, eos, tok, a.samples
    )
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    write_summary(out, summary)
    return summary


def header(a, model, data: Data, probe: dict, device: torch.device) -> dict:
    """What the run is: the machine, the model, the data and the step's speed."""
    n = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, a.seq_len)
    probe["flops_per_token"] = round(fpt)
    ms = probe.get("compiled_ms") if probe.get("used") == "compiled" else probe["eager_ms"]
    probe["tokens_per_s"] = round(a.budget / (ms / 1e3))
    probe["model_tflops"] = round(probe["tokens_per_s"] * fpt / 1e12, 1)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    import transformers

    return {
        "machine": {"device": gpu, "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "model": {"params": n, "dim": a.dim, "mlp_dim": a.mlp_dim, "n_layers": a.n_layers,
                  "n_heads": a.n_heads, "vocab_size": model.config.vocab_size,
                  "rope_theta": a.rope_theta},
        "train": {"seq_len": a.seq_len, "batch_tokens": a.budget, "lr": a.lr,
                  "warmup": a.warmup, "weight_decay": a.weight_decay, "epochs": a.arms,
                  "init": a.init or None, "minutes": a.minutes},
        "data": data.meta,
        "step": probe,
        "arms": [],
    }  # fmt: skip


if __name__ == "__main__":
    main()
