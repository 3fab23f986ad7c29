"""The readout decoder's trainer at scale: fresh task-suite prompts every step, the teacher
from one verifying forward, DistributedDataParallel under torchrun on every GPU of a machine
(or one GPU, or the CPU), bf16 autocast, a wall-clock budget with a cosine schedule planned
from the measured pace, resumable from its state file.

    torchrun --standalone --nproc_per_node=2 -m stateblock.train.readout_ddp \\
        --base models/reference/base --out runs/readout --minutes 8

Per step, per rank: loader workers draw fresh training prompts with their true answers and
pack them into a padded-token budget; ONE forward of the frozen base over prompt + answer +
EOS gives both the captured rows (the prompt's final hidden rows: causal attention makes
them the serving capture's) and the teacher. Greedy decoding emits argmax(next | prefix), so
where the forward's argmax reproduces the true answer and then EOS, the teacher's greedy
answer IS the true answer; where it first deviates at position j, the teacher's answer is
known up to and including j (truth[:j] + its own token j) and the positions after j are left
out of the loss. No step-by-step decoding, so the teacher costs one forward.

The loss is the cross-entropy of every pass (first guess and each refinement), averaged.
At the end rank 0 writes the decoder (`stateblock.model.checkpoint`, bound to the base) and a
held-out report of readout vs teacher where the teacher's greedy answer is verified; the
full report with step-by-step teachers is `stateblock eval`. docs/QUALITY.md has the runs.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stateblock.model import checkpoint as ckpt
from stateblock.model.capture import backbone
from stateblock.model.copy_head import target_log_probs
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.train import ddp, tasks
from stateblock.train.base_ddp import FastEnc, Stream
from stateblock.train.batching import budget_batches
from stateblock.train.ddp import log
from stateblock.train.step_profile import StepProfile
from stateblock.train.weights import read_state, restore, save_state

FORMAT_NOTE = "fresh prompts per step, teacher = verified truth prefix (readout_ddp)"


class Passes(nn.Module):
    """The decoder's training view, as one module call (what DDP wraps)."""

    def __init__(self, decoder: ReadoutDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, rows, lens, positions, lm_head) -> list[Tensor]:
        return self.decoder.pass_logits(rows, lens, positions, lm_head)


@torch.no_grad()
def teacher_batch(base, ids: Tensor, lab: Tensor, amp) -> tuple[Tensor, Tensor, Tensor, dict]:
    """One frozen forward over (prompt + truth + EOS) rows -> rows (B, P, d), prompt_lens (B,),
    targets (B, D) (-100 where the teacher's token is unknown) and counts.

    lab is the base trainer's label tensor: lab[t] = ids[t + 1] on answer and EOS tokens."""
    with amp:
        hidden = backbone(base)(input_ids=ids).last_hidden_state  # (B, W, d), final norm applied
        pred = base.lm_head(hidden).argmax(-1)  # (B, W) the teacher's next token everywhere
    known = lab != -100  # (B, W): positions whose next token is an answer token or EOS
    first = known.float().argmax(-1)  # (B,) = prompt_len - 1
    lens = first + 1
    n_ans = known.sum(-1)  # answer + EOS
    d = int(n_ans.max())
    b = ids.shape[0]
    col = first.unsqueeze(1) + torch.arange(d, device=ids.device).unsqueeze(0)  # (B, D)
    col = col.clamp(max=ids.shape[1] - 1)
    in_ans = torch.arange(d, device=ids.device).unsqueeze(0) < n_ans.unsqueeze(1)
    truth = torch.where(in_ans, lab.gather(1, col), -100)
    guess = torch.where(in_ans, pred.gather(1, col), -100)
    wrong = (truth != guess) & in_ans
    # positions after the first deviation: the teacher's own answer there is unknown
    after = wrong.int().cumsum(-1) - wrong.int() > 0
    target = torch.where(after, -100, guess)  # == truth up to the deviation, teacher's at it
    p = int(lens.max())
    stats = {"lanes": b, "teacher_deviates": int(wrong.any(-1).sum())}
    return hidden[:, :p].float(), lens, target, stats


def answer_loss(
    logits: Tensor, target: Tensor, eos: int, eos_weight: float = 1.0, extra: Tensor | None = None
) -> Tensor:
    """Cross-entropy over the scored positions (target -100 is not scored), the EOS targets
    weighted `eos_weight` times: an answer of 3,000 tokens has one EOS, whose gradient is
    otherwise a 3,000th of the answer's, and a readout that never stops is wrong however
    right its tokens (the counting families' only errors were a missing EOS)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100,
                         reduction="none")  # fmt: skip
    flat = target.flatten()
    w = torch.where(flat == eos, eos_weight, 1.0) * (flat != -100)
    if extra is not None:  # (B, D) per-position weights, e.g. near_end_weights
        w = w * extra.flatten()
    return (ce * w).sum() / w.sum().clamp_min(1.0)


def parts_loss(parts: tuple, target: Tensor, eos: int, eos_weight: float = 1.0) -> Tensor:
    """`answer_loss` of one pass's distribution (`ReadoutDecoder.pass_parts`): its logits',
    or a copy mixture's log-probabilities gathered at the targets (no (B, D, V) mixture)."""
    if parts[0] == "base":
        return answer_loss(parts[1], target, eos, eos_weight)
    lp = target_log_probs(parts, target)  # (B, D)
    w = torch.where(target == eos, eos_weight, 1.0) * (target != -100)
    return -(lp * w).sum() / w.sum().clamp_min(1.0)


def near_end_weights(
    target: Tensor, eos: int, sep: int, weight: float, max_item: int = 12
) -> Tensor:
    """(B, D) loss weights: `weight` on every separator that follows an item one character
    away from the answer's last item, 1 elsewhere (and on lanes without a known end).

    The long answers' misses are early stops right after such an item (`alpha: hmw hzc`
    stopped after `hnc`, `countdown: 640 533` after `633`): there the separator and EOS are
    the confusable pair, as they are when EOS is not weighted. Items are the runs between
    separators; only items of the last item's length (at most `max_item`) are compared."""
    b, d = target.shape
    idx = torch.arange(d, device=target.device)
    is_end, is_sep = target == eos, target == sep
    e = is_end.float().argmax(-1)  # (B,) the first end (0 where none)
    last_sep = torch.where(is_sep & (idx < e[:, None]), idx, -1).max(-1).values  # (B,)
    n = e - last_sep - 1  # (B,) the last item's length
    lane = is_end.any(-1) & (last_sep >= 0) & (n >= 1) & (n <= max_item)
    start = idx[None, :] - n[:, None]  # (B, D) where the item ending before each position starts
    after_sep = is_sep.gather(1, (start - 1).clamp(min=0)) & (start >= 1)
    cand = is_sep & (idx < e[:, None]) & lane[:, None] & ((start == 0) | after_sep)
    diff = torch.zeros(b, d, dtype=torch.int32, device=target.device)
    for j in range(max_item):
        here = target.gather(1, (start + j).clamp(0, d - 1))  # (B, D) item char j
        last = target.gather(1, (e - n + j).clamp(0, d - 1).unsqueeze(1))  # (B, 1)
        diff += ((j < n)[:, None] & (here != last)).int()
    return torch.where(cand & (diff == 1), weight, 1.0)


def stop_loss(logits: Tensor, target: Tensor, eos: int) -> Tensor:
    """Where the answer ends, as one decision per lane: the softmax over the lane's
    positions of the EOS log-odds s_p = log p(EOS) - log(1 - p(EOS)), cross-entropy
    against the position of its EOS target. Lanes without one (the teacher deviated before
    its end) are not scored.

    Per-position cross-entropy trains each EOS decision alone; its misses on long answers
    were one spurious EOS in place of a separator, at a low margin, while the true end's
    log-odds were high. This loss compares the positions with each other, so its gradient
    goes to the runner-up positions (the confusable separators), and it also scores the
    positions past the end, which the token loss leaves untrained."""
    lp = logits.float().log_softmax(-1)[..., eos]  # (B, D) log p(EOS)
    s = lp - torch.log1p(-lp.exp().clamp(max=1.0 - 1e-6))  # (B, D) log-odds
    end = target == eos  # (B, D)
    lanes = end.any(-1)
    if not bool(lanes.any()):
        return s.sum() * 0.0  # keeps the graph (DDP) while scoring nothing
    return F.cross_entropy(s[lanes], end[lanes].float().argmax(-1))


def widen_latents(state: dict[str, Tensor], n_latent: int) -> dict[str, Tensor]:
    """A start for a decoder with more latent slots (`{"n_latent": 128}` over a 64-slot
    decoder): the trained slots tiled, each copy after the first nudged, since identical
    slots receive identical gradients and would stay copies."""
    old = state["latent"]  # (M, d_r)
    if old.shape[0] == n_latent:
        return state
    if n_latent % old.shape[0]:
        raise ValueError(f"n_latent {n_latent} is not a multiple of the start's {old.shape[0]}")
    g = torch.Generator().manual_seed(0)
    copies = [old] + [
        old + torch.randn(old.shape, generator=g).to(old) * old.std() * 0.05
        for _ in range(n_latent // old.shape[0] - 1)
    ]
    return {**state, "latent": torch.cat(copies)}


_STACKS = re.compile(r"^(mixer|row_cross|ref_mixer|ref_cross)\.\d+\.")


def deepen(state: dict[str, Tensor], decoder: ReadoutDecoder) -> dict[str, Tensor]:
    """A start for a decoder with more layers in a stack (`{"n_ref_mixer": 3}` over a
    two-layer one): the trained layers as they were, each new (appended) layer at its fresh
    init with its attention and MLP outputs zeroed, so it starts as the identity and the
    start computes exactly what the trained decoder did."""
    fresh = decoder.state_dict()
    fewer = sorted(state.keys() - fresh.keys())
    if fewer:
        raise ValueError(f"the start has weights this decoder lacks: {fewer[:4]}")
    out = dict(state)
    for key in sorted(fresh.keys() - state.keys()):
        if not _STACKS.match(key):
            raise ValueError(f"the start lacks {key}, which is not a layer of a mixer stack")
        t = fresh[key].detach().clone()
        if key.endswith(("attn.wo.weight", "mlp.w2.weight")):
            t.zero_()
        out[key] = t
    return out


def build_decoder(base, tok, overrides: dict) -> ReadoutDecoder:
    cfg = ReadoutConfig(
        d_base=base.config.hidden_size,
        vocab_size=base.lm_head.weight.shape[0],
        eos_token_id=tok.eos_token_id,
        **overrides,
    )
    return ReadoutDecoder(cfg)


@torch.no_grad()
def heldout_report(
    base, decoder, enc, device, amp, n_each: int, seed: int, split: str = "heldout"
) -> dict:
    """Readout vs teacher on held-out prompts whose teacher answer the forward verifies
    (teacher == truth, then EOS); prompts where it deviates are counted, not scored.
    `split="train"`: the same on prompts of the training split (drawn the way training
    draws them), for the train - held-out gap."""
    exs = tasks.per_family(n_each, split=split, seed=seed)
    seqs = [(enc.prompt(e.prompt), enc.answer(e.answer) + [enc.eos]) for e in exs]
    lens = [len(p) + len(t) for p, t in seqs]
    lm_head = base.lm_head.weight.float()
    res: dict[str, dict[str, list]] = {"family": defaultdict(list), "bucket": defaultdict(list)}
    tok_agree: dict[str, list] = defaultdict(list)
    deviates = 0
    decoder.eval()
    for b in budget_batches(lens, 32768, max_batch=128):
        w = max(lens[i] for i in b)
        ids = torch.full((len(b), w), enc.pad, dtype=torch.long)
        lab = torch.full((len(b), w), -100, dtype=torch.long)
        for r, i in enumerate(b):
            p, t = seqs[i]
            ids[r, : lens[i]] = torch.tensor(p + t)
            lab[r, len(p) - 1 : lens[i] - 1] = torch.tensor(t)
        rows, plens, target, _ = teacher_batch(base, ids.to(device), lab.to(device), amp)
        d = target.shape[1]
        pos = torch.arange(d, device=device).expand(len(b), -1)
        out = decoder(rows, plens, pos, torch.full((len(b),), d, device=device), lm_head)
        got = out.tokens.cpu()
        for r, i in enumerate(b):
            t = torch.tensor(seqs[i][1])
            if bool((target[r, : len(t)].cpu() != t).any()):
                deviates += 1
                continue
            e = exs[i]
            ok = bool(torch.equal(got[r, : len(t)], t))
            res["family"][e.family].append(ok)
            res["bucket"][tasks.bucket_of(len(e.answer) or 1)].append(ok)
            tok_agree[tasks.bucket_of(len(e.answer) or 1)].append(
                float((got[r, : len(t)] == t).float().mean())
            )
    mean = lambda v: round(sum(v) / len(v), 3)  # noqa: E731
    return {
        "exact_by_family": {f: mean(v) for f, v in sorted(res["family"].items())},
        "exact_by_bucket": {k: [mean(v), len(v)] for k, v in sorted(res["bucket"].items())},
        "token_agreement_by_bucket": {k: mean(v) for k, v in sorted(tok_agree.items())},
        "teacher_deviates": deviates,
        "n_each": n_each,
        "seed": seed,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    batch = (256, "prompts a batch, per GPU")
    ap = ddp.ddp_parser(
        "stateblock.train.readout_ddp", __doc__, minutes=8.0, batch=batch, lr=1e-3, warmup=200
    )
    add = ap.add_argument
    add("--base", required=True, help="the frozen base model directory (HF)")
    add("--out", required=True, help="writes OUT/decoder (checkpoint) and OUT/state.pt (resume)")
    add(
        "--schedule-minutes", type=float, default=None,
        help="plan the cosine over this many minutes (default --minutes): later runs resume it",
    )  # fmt: skip
    add("--decoder-config", default="{}", help="JSON ReadoutConfig overrides (new runs, or --init)")
    add("--init", default="", help="a saved decoder dir to start from when OUT has no state")
    add("--eos-weight", type=float, default=1.0, help="loss weight of the EOS targets")
    add("--stop-weight", type=float, default=0.0, help="weight of the per-lane stop loss")
    add(
        "--near-end-weight", type=float, default=1.0,
        help="loss weight of separators after an item one character from the last item",
    )  # fmt: skip
    add("--eval-each", type=int, default=30, help="held-out prompts a family at the end (0: none)")
    add("--profile-steps", type=int, default=0, help="profile this many steps: OUT/profile.txt")
    add("--profile-from", type=int, default=50, help="the run's step the profile starts at")
    return ap.parse_args(argv)


def load_base(base_dir: str, device: torch.device):
    """The tokenizer, the fast encoder (checked against it) and the frozen base model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    enc = FastEnc(base_dir)
    for e in tasks.generate(200, split="heldout", seed=5):  # the fast encoder is the tokenizer
        assert tok(e.prompt)["input_ids"] == enc.prompt(e.prompt), e.prompt
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, local_files_only=True, dtype=torch.float32
    )
    base.to(device).eval().requires_grad_(False)
    return tok, enc, base


def start_decoder(
    a: argparse.Namespace, base, tok, st: dict | None, device: torch.device
) -> tuple[ReadoutDecoder, dict, int, int]:
    """The decoder this run trains, its config overrides, and the step and prompts seen it
    starts from: resumed state's config, or --init's weights (a fresh optimizer), or new."""
    overrides = st["decoder_config"] if st else json.loads(a.decoder_config)
    init = None
    step, seen = 0, 0
    if not st and a.init:  # another machine's stage: its bf16 weights, a fresh optimizer
        manifest = ckpt.read_manifest(a.init)
        try:
            ckpt.check_identity(manifest, a.base, base.lm_head.weight)
        except ckpt.DecoderMismatch as e:
            # a decoder of an earlier base (a base stage ran since): a start, not a binding;
            # the decoder this run saves is bound to --base
            log(f"init from a decoder of another base ({e}): its weights are a start only")
        init = ckpt.build_decoder(a.init, manifest)
        known = {f.name for f in fields(ReadoutConfig)} - {"d_base", "vocab_size", "eos_token_id"}
        overrides = {k: v for k, v in manifest["decoder_config"].items() if k in known}
        # passes share their weights, so e.g. {"refine": 2} fine-tunes the same parameters
        overrides |= json.loads(a.decoder_config)
        seen = manifest["training"].get("prompts_seen", 0)
        step = manifest["training"].get("steps", 0)
    torch.manual_seed(a.seed)
    decoder = build_decoder(base, tok, overrides).to(device)
    if init is not None:
        start = widen_latents(init.state_dict(), decoder.cfg.n_latent)
        decoder.load_state_dict(deepen(start, decoder))
        log(f"init from {a.init} (step {step}, bf16 weights, new optimizer)")
    return decoder, overrides, step, seen


def resume(
    a: argparse.Namespace, st: dict | None, decoder: ReadoutDecoder, opt, step: int, seen: int
) -> tuple[int, int | None, int, int]:
    """(step, total, seen, origin): the saved state's, loaded into decoder and optimizer, or
    a new plan from `step`. origin is where the warm-up + cosine began."""
    total = None
    origin = step
    if st:
        st = restore(st, {"decoder": decoder, "opt": opt})
        step, total, seen = st["step"], st["total"], st.get("seen", 0)
        origin = st.get("origin", step)  # older states: the schedule restarts (as it did)
        log(f"resumed at step {step}/{total}")
        if a.reschedule or (total is not None and step >= total):  # a finished plan: anew
            total, origin = None, step
    return step, total, seen, origin


def batch_loss(a, base, dmodel, tok, enc, lm_head, ids, lab, amp) -> tuple[Tensor, Tensor, dict]:
    """(loss, target, info) of one batch: the teacher's rows and targets, every pass's loss."""
    device = lm_head.device
    rows, lens, target, info = teacher_batch(base, ids.to(device), lab.to(device), amp)
    pos = torch.arange(target.shape[1], device=device).expand(target.shape[0], -1)
    with amp:
        logits = dmodel(rows, lens, pos, lm_head)
    extra = None
    if a.near_end_weight != 1.0:
        extra = near_end_weights(target, tok.eos_token_id, enc.char[" "], a.near_end_weight)
    loss = sum(answer_loss(lg, target, tok.eos_token_id, a.eos_weight, extra) for lg in logits)
    if a.stop_weight:
        loss = loss + a.stop_weight * sum(stop_loss(lg, target, tok.eos_token_id) for lg in logits)
    return loss / len(logits), target, info


def decoder_identity(base_dir: str, lm_head: Tensor) -> dict:
    """What the saved decoder is bound to: the base, its tokenizer and lm_head, the data."""
    return {
        "base_model_digest": ckpt.base_model_digest(base_dir),
        "tokenizer_digest": ckpt.tokenizer_digest(base_dir),
        "lm_head_digest": ckpt.tensor_digest(lm_head),
        "data_digest": ckpt.sha_files([Path(tasks.__file__)]),
    }


def add_heldout(stats: dict, base, decoder, enc, device, amp, n_each: int) -> None:
    """Exact-match rates on held-out and training prompts, and their gap, into `stats`."""
    t1 = time.perf_counter()
    stats["heldout"] = heldout_report(base, decoder, enc, device, amp, n_each, 1234)
    train = heldout_report(base, decoder, enc, device, amp, n_each, 1234, "train")
    stats["train_split"] = train
    stats["train_minus_heldout_exact"] = {
        b: round(train["exact_by_bucket"][b][0] - v[0], 3)
        for b, v in stats["heldout"]["exact_by_bucket"].items()
        if b in train["exact_by_bucket"]
    }
    stats["eval_seconds"] = round(time.perf_counter() - t1, 1)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    r = ddp.init_ranks(a.device)
    rank, world, device = r.rank, r.world, r.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, enc, base = load_base(a.base, device)
    lm_head = base.lm_head.weight  # (V, d_base), frozen

    state_file = out / "state.pt"
    st = read_state(state_file, device)
    decoder, overrides, step, seen = start_decoder(a, base, tok, st, device)
    n_params = sum(p.numel() for p in decoder.parameters())
    log(f"decoder params {n_params} ({n_params * 2 / 1e6:.1f} MB bf16) config {overrides}")
    opt = torch.optim.AdamW(
        decoder.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95),
        fused=a.device == "cuda",
    )  # fmt: skip
    step, total, seen, origin = resume(a, st, decoder, opt, step, seen)
    dmodel = ddp.data_parallel(Passes(decoder), r)
    weights = json.loads(a.weights)
    dl = ddp.loader(
        Stream(a.base, f"r{a.seed}-{rank}-{step}", a.budget, a.max_batch, a.pool, weights),
        a.workers,
    )
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.device == "cuda")
    start = step
    plan = ddp.Plan(
        r, start, total, a.minutes, a.max_steps, min(a.max_steps, 4000), a.schedule_minutes
    )
    dev_count = 0
    prof = StepProfile(a.profile_steps if rank == 0 else 0, out / "profile.txt", a.profile_from)
    decoder.train()
    for ids, lab in dl:
        prof.before(step - start)
        steps = plan.steps(step)
        for g in opt.param_groups:
            g["lr"] = ddp.lr_at(step - origin, steps - origin, a.lr, a.warmup)
        loss, target, info = batch_loss(a, base, dmodel, tok, enc, lm_head, ids, lab, amp)
        seen += info["lanes"] * world
        dev_count += info["teacher_deviates"]
        step += 1
        note = f"seen {seen} shape {tuple(target.shape)}"
        plan.update(opt, decoder.parameters(), loss, step, note)
        if plan.done(step):
            break
    prof.close(step - start)
    train_s = time.perf_counter() - plan.t0
    total, losses = plan.total, plan.losses
    agree = ddp.ranks_agree(decoder, r)  # every rank, before rank 0 alone saves
    if rank == 0:
        decoder.eval()
        save_state(
            state_file, {"decoder": decoder, "opt": opt}, step=step, total=total, seen=seen,
            origin=origin, decoder_config=overrides,
        )  # fmt: skip
        stats = {
            "steps": step,
            "steps_this_run": step - start,
            "train_seconds": round(train_s, 1),
            "prompts_seen": seen,
            "teacher_deviating_lanes_rank0": dev_count,
            "final_loss": losses[-1] if losses else None,
            "params": n_params,
            "world": world,
            "ranks_agree": agree,
            "device": torch.cuda.get_device_name(device) if a.device == "cuda" else "cpu",
            "config": {**vars(a), "max_answer": 3100, "decoder": overrides, "data": FORMAT_NOTE},
        }
        identity = decoder_identity(a.base, lm_head)
        ckpt.save_decoder(out / "decoder", decoder, identity, {"training": stats})
        if a.eval_each:
            add_heldout(stats, base, decoder, enc, device, amp, a.eval_each)
        log(json.dumps(stats))
        (out / "stats.json").write_text(json.dumps(stats, indent=2))
    ddp.leave(r)


if __name__ == "__main__":
    main()
