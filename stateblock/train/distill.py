"""Distillation: a readout decoder learns the base model's own greedy answers from one capture.

The base model and its lm_head stay frozen; the student sees only the final hidden rows of
the prompt (one forward, the same capture the server runs) and is trained with
cross-entropy on every answer position and the EOS position, all positions at once.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from stateblock.model import checkpoint as ckpt
from stateblock.model.capture import lm_head_weight
from stateblock.model.copy_head import space_twins
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.loading import load_base
from stateblock.model.pointer import capture_pointing, map_count
from stateblock.train.batching import budget_batches
from stateblock.train.readout_ddp import parts_loss
from stateblock.train.reference import StepPlan, lr_at
from stateblock.train.teacher import greedy_answers, load_cache, save_cache
from stateblock.train.weights import read_state, restore, save_state

MAX_SKIPPED = 10  # non-finite steps a run absorbs (or a twentieth of its steps) before failing


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 6000
    token_budget: int = 49152  # answer positions per step (lanes x padded depth)
    max_lanes: int = 256
    max_answer: int = 4096  # teacher envelope: longer greedy answers are cut here
    decode_limit: int | None = None  # at most this many prompts decoded step by step
    decode_budget: int | None = None  # tokens per step-by-step decode batch
    lr: float = 1e-3
    # the copy head's bonuses (a few scalars from 0) at this multiple of the rate: at the
    # rate itself they stay too small to decide anything (docs/QUALITY.md)
    bonus_lr: float = 30.0
    warmup: int = 200
    seed: int = 0
    ckpt_every: int = 500
    max_minutes: float = 0.0  # >0: shrink the step count to fit (decided at step 80, logged)
    stop_after: int | None = None  # leave a checkpoint after this step (time-sliced runs)
    eos_weight: float = 1.0  # loss weight of the EOS targets (readout_ddp's --eos-weight)
    decoder: dict = field(default_factory=dict)  # ReadoutConfig overrides
    # a finished decoder of the same shape and base whose weights start the run (another
    # call's: a call carries its bf16 weights, not the optimizer's state); a fresh optimizer
    init: str | None = None


def read_prompts(path: str | Path) -> list[dict]:
    """JSONL: {"prompt": str, "answer"?: str (a candidate that speeds up the teacher),
    "family"?: str}."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise ValueError(f"{path}:{i + 1}: every line needs a non-empty 'prompt'")
    return rows


def build_teacher(base, tok, prompts: list[dict], cache: Path, cfg: DistillConfig, device) -> tuple:
    """Teacher records (cached on disk) and the cache's digest."""
    if cache.exists():
        return load_cache(cache)
    ids = tok([p["prompt"] for p in prompts])["input_ids"]
    cand = tok([p.get("answer", "") for p in prompts], add_special_tokens=False)["input_ids"]
    answers = greedy_answers(
        base,
        list(zip(ids, cand, strict=True)),
        eos=tok.eos_token_id,
        pad=tok.pad_token_id,
        max_new=cfg.max_answer,
        device=device,
        decode_limit=cfg.decode_limit,
        decode_budget=cfg.decode_budget,
    )
    records = [
        {"prompt": p["prompt"], "family": p.get("family", ""), "prompt_ids": i, "answer_ids": a}
        for p, i, a in zip(prompts, ids, answers, strict=True)
        if a is not None  # over the decode limit: dropped, counted in the training stats
    ]
    digest = save_cache(cache, records)
    return records, digest


def _batch(records, idx, device, pad: int):
    prompts = [records[i]["prompt_ids"] for i in idx]
    answers = [records[i]["answer_ids"] for i in idx]
    p_w, d = max(map(len, prompts)), max(map(len, answers))
    ids = torch.full((len(idx), p_w), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    tgt = torch.full((len(idx), d), -100, dtype=torch.long)
    for r, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        ids[r, : len(p)], mask[r, : len(p)] = torch.tensor(p), 1
        tgt[r, : len(a)] = torch.tensor(a)  # the teacher's tokens, EOS included when emitted
    lens = mask.sum(-1)
    return ids.to(device), mask.to(device), lens.to(device), tgt.to(device)


def new_decoder(base, tok, lm_head: torch.Tensor, cfg: DistillConfig, device) -> ReadoutDecoder:
    """A freshly initialised decoder (seeded by cfg.seed) for `base`'s width and vocabulary;
    `copy_point: -1` reads every one of the base's attention heads."""
    shape = dict(cfg.decoder)
    if shape.get("copy_point") == -1:
        shape["copy_point"] = map_count(base)
    dcfg = ReadoutConfig(
        d_base=base.config.hidden_size,
        vocab_size=lm_head.shape[0],
        eos_token_id=tok.eos_token_id,
        **shape,
    )
    torch.manual_seed(cfg.seed)
    decoder = ReadoutDecoder(dcfg)
    if dcfg.copy:  # the copy head's twin spellings, from this base's tokenizer
        decoder.twins.copy_(space_twins(tok.get_vocab(), dcfg.vocab_size))
    return decoder.to(device)


def resume_state(resume: Path, decoder: ReadoutDecoder, opt, steps: int, device) -> tuple:
    """(start, steps): a saved run's step and plan, loaded into decoder and optimizer, or
    (0, steps). Resumable: same batches, same step index, same optimizer state."""
    saved = read_state(resume, device)
    if saved is None:
        return 0, steps
    state = restore(saved, {"decoder": decoder, "opt": opt})
    return state["step"], state["steps"]


def start_from(decoder: ReadoutDecoder, init: Path, identity: dict, device) -> None:
    """Load the weights of the finished decoder at `init` into `decoder`; ValueError unless
    it was made for the same base (identity's digests) and has this decoder's shape."""
    manifest = ckpt.read_manifest(init)
    for key in ("base_model_digest", "tokenizer_digest", "lm_head_digest"):
        if manifest.get(key) != identity.get(key):
            raise ValueError(f"{init}: made for another base ({key} differs)")
    prev = ckpt.build_decoder(init, manifest, device=device, dtype=torch.float32)
    try:
        decoder.load_state_dict(prev.state_dict())
    except RuntimeError as e:
        raise ValueError(f"{init}: not this config's decoder shape ({e})") from e


def _is_bonus(name: str) -> bool:
    return name.startswith("copy_head.w_")  # the copy head's learned bonuses (few scalars)


def param_groups(decoder: nn.Module, bonus_lr: float) -> list[dict]:
    """The decoder's parameters for the optimizer, the copy head's bonuses apart at
    `bonus_lr` times the rate (`lr_scale`): scalars that start at 0 and move about the rate a
    step would take thousands of steps to reach a decisive few nats."""
    named = list(decoder.named_parameters())
    groups = [{"params": [p for n, p in named if not _is_bonus(n)], "lr_scale": 1.0}]
    if bonus := [p for n, p in named if _is_bonus(n)]:
        groups.append({"params": bonus, "lr_scale": bonus_lr})
    return groups


def bonuses(decoder: nn.Module) -> dict:
    """The copy head's bonuses as they stand, rounded (for logs)."""
    return {n.removeprefix("copy_head."): [round(v, 3) for v in p.detach().flatten().tolist()]
            for n, p in decoder.named_parameters() if _is_bonus(n)}  # fmt: skip


def train_step(
    decoder, opt, base, lm_head, batch: tuple, lr: float, amp, eos_weight: float = 1.0
) -> tuple[torch.Tensor, bool]:
    """One optimizer step on one batch: the base's rows, the decoder's cross-entropy averaged
    over its passes (first guess and each refinement), EOS targets weighted `eos_weight`.
    (loss, stepped): a batch whose gradient is not finite is skipped, not applied; clipping a
    NaN norm would otherwise turn every weight into NaN for the rest of the run."""
    ids, mask, lens, tgt = batch
    # (K, P, d_base), frozen; right-padded, so the maps read each lane's last position
    rows, point = capture_pointing(base, ids, lens, mask, maps=bool(decoder.cfg.copy_point))
    pos = torch.arange(tgt.shape[1], device=tgt.device).expand(tgt.shape[0], -1)
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    with amp:
        passes = decoder.pass_parts(rows, lens, pos, lm_head, ids, point)  # [(K, D, V) or parts]
    eos = decoder.cfg.eos_token_id
    loss = sum(parts_loss(p, tgt, eos, eos_weight) for p in passes) / len(passes)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
    if not torch.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        return loss, False
    opt.step()
    return loss, True


def base_identity(base_dir: str | Path, lm_head: torch.Tensor) -> dict:
    """The digests a decoder's manifest binds it to: base model, tokenizer and lm_head."""
    return {
        "base_model_digest": ckpt.base_model_digest(base_dir),
        "tokenizer_digest": ckpt.tokenizer_digest(base_dir),
        "lm_head_digest": ckpt.tensor_digest(lm_head),
    }


def train_decoder(
    base_dir: str | Path,
    prompts_file: str | Path,
    out_dir: str | Path,
    cfg: DistillConfig,
    *,
    device: str = "cpu",
    data_dir: str | Path = "data",
) -> dict:
    """A decoder distilled from the base's greedy answers to the prompts of a JSONL file
    (the teacher cached under data_dir), written to out_dir."""
    base, tok = load_base(base_dir, device)
    lm_head = lm_head_weight(base)
    identity = base_identity(base_dir, lm_head)
    prompts = read_prompts(prompts_file)
    key = ckpt.sha_files([Path(prompts_file)])[:16] + "-" + identity["base_model_digest"][:16]
    t0 = time.perf_counter()
    records, data_digest = build_teacher(
        base, tok, prompts, Path(data_dir) / f"teacher-{key}.jsonl", cfg, device
    )
    stats = {"teacher_seconds": round(time.perf_counter() - t0, 1),
             "teacher_dropped": len(prompts) - len(records)}  # fmt: skip
    return fit(base, tok, records, {**identity, "data_digest": data_digest}, out_dir, cfg,
               device, stats)  # fmt: skip


def fit(
    base, tok, records: list[dict], identity: dict, out_dir: str | Path, cfg: DistillConfig,
    device: str, stats: dict | None = None,
) -> dict:  # fmt: skip
    """Train a decoder on teacher records ({"prompt_ids", "answer_ids"}: the base's greedy
    answer, EOS included when emitted) and save it to out_dir bound to `identity`;
    resumable from out_dir/ckpt.pt (same batches, same step index, same optimizer state)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm_head = lm_head_weight(base)
    decoder = new_decoder(base, tok, lm_head, cfg, device)
    opt = torch.optim.AdamW(param_groups(decoder, cfg.bonus_lr), lr=cfg.lr, weight_decay=0.01,
                            betas=(0.9, 0.95))  # fmt: skip
    resume = out / "ckpt.pt"
    if cfg.init and not resume.exists():
        start_from(decoder, Path(cfg.init), identity, device)
    start, steps = resume_state(resume, decoder, opt, cfg.steps, device)
    lengths = [len(r["answer_ids"]) for r in records]
    batches = budget_batches(lengths, cfg.token_budget, max_batch=cfg.max_lanes, seed=cfg.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    decoder.train()
    t1 = time.perf_counter()
    loss, skipped = torch.tensor(float("nan")), 0
    bar = tqdm(desc="distill", initial=start, total=steps, mininterval=5)
    step, plan = start, StepPlan(steps, 80, cfg.max_minutes, start)
    while step < steps:
        steps = bar.total = plan.plan(step)
        batch = _batch(records, batches[step % len(batches)], device, tok.pad_token_id)
        lr = lr_at(step, steps, cfg.lr, cfg.warmup)
        loss, stepped = train_step(decoder, opt, base, lm_head, batch, lr, amp, cfg.eos_weight)
        skipped += not stepped
        if skipped > max(MAX_SKIPPED, step // 20):
            raise RuntimeError(f"distillation diverged: {skipped} of {step + 1 - start} steps "
                               "had a gradient that was not finite")  # fmt: skip
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        step += 1
        bar.update(1)
        cut = cfg.stop_after is not None and step >= cfg.stop_after
        if (step % cfg.ckpt_every == 0 or cut) and step < steps:
            save_state(resume, {"decoder": decoder, "opt": opt}, step=step, steps=steps)
        if cut and step < steps:
            return {"stopped_at": step, "steps": steps}
    stats = {
        "steps": steps,
        "train_seconds": round(time.perf_counter() - t1, 1),
        **(stats or {}),
        "final_loss": float(loss.item()),
        "skipped_steps": skipped,
        "device": device,
        "examples": len(records),
        "params": sum(p.numel() for p in decoder.parameters()),
        **({"bonuses": b} if (b := bonuses(decoder)) else {}),
    }
    ckpt.save_decoder(out, decoder.eval(), identity, {"training": {**stats, "config": asdict(cfg)}})
    resume.unlink(missing_ok=True)
    return stats
