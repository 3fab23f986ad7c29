"""The copy-head ablation (issue 41): a readout that can point at the prompt's tokens against
one that must spell every answer token through the base's lm_head.

Three of the four determined prose families copy a span of the prompt (repeat, next_sentence,
question), and the readout copies badly: it reaches a prompt token only through a captured
row, whose final hidden state is the base's guess at the token after it. A copy head scores
every prompt position for every answer position (queries from the readout's state, keys from
the row with the lm_head rows of the row's token and of the one before it, rotary positions
on both) and the answer token's probability is mixed from the vocabulary's and the positions':

    gate   g * softmax(vocab) + (1 - g) * softmax(positions), g a learned sigmoid
    joint  one softmax over [vocab logits ; position scores] (a token's positions add up)
    twin   joint, plus a second score per position for the row's token without its leading
           space (the byte-level BPE spells a word that starts an answer without it: " the"
           in a passage is `the` after `<ans>`), where the vocabulary has that token
    gatetwin  gate, its position softmax over twin's two scores a position

Arms train the shipped decoder shape (`recipe.DECODER_CONFIG`) on the same rows, batches and
steps, on the CPU: the rows of a pair's tuned base for its teacher's determined answers (up
to --max-answer tokens), captured once. Held-out exact match and token agreement with the
teacher, by family, at every --eval-every steps:

    python -m stateblock.train.copy_ablation --pair DIR --out OUT [--arms base,gate,joint,twin]
        [--train 16000] [--steps 800] [--threads 2]

DIR holds `tuned/` (the base, tokenizer beside) and `teacher/{train,heldout}.jsonl`
(`prose_readout`'s work folder). docs/QUALITY.md has the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from stateblock.model.capture import capture, lm_head_weight
from stateblock.model.decoder import (
    PrefixCausal,
    ReadoutConfig,
    ReadoutDecoder,
    position_features,
    rope_tables,
    rotate,
)
from stateblock.train.ddp import lr_at
from stateblock.train.prose_tasks import DETERMINED
from stateblock.train.readout_ddp import answer_loss
from stateblock.train.recipe import DECODER_CONFIG

ARMS = ("base", "gate", "joint", "twin", "gatetwin")
SPACE = "\u0120"  # the byte-level BPE's mark of a leading space
NEG = float("-inf")


def space_twins(vocab: dict[str, int]) -> Tensor:
    """(V,) the id of each token's spelling without its leading space, -1 where the token has
    no leading space or the vocabulary lacks the shorter spelling."""
    twins = torch.full((max(vocab.values()) + 1,), -1, dtype=torch.long)
    for text, i in vocab.items():
        if text.startswith(SPACE) and text[1:] in vocab:
            twins[i] = vocab[text[1:]]
    return twins


class CopyHead(nn.Module):
    def __init__(
        self, d_r: int, d_base: int, mode: str, theta: float = 10000.0, bias: float | None = None
    ) -> None:
        super().__init__()
        self.mode, self.d, self.theta = mode, d_r, theta
        self.q = nn.Linear(d_r, d_r, bias=False)
        self.k = nn.Linear(d_r, d_r, bias=False)
        self.tok = nn.Linear(d_base, d_r, bias=False)  # the row's own token
        self.prev = nn.Linear(d_base, d_r, bias=False)  # the token before it: induction
        self.gated, self.twin = mode in ("gate", "gatetwin"), mode in ("twin", "gatetwin")
        if self.gated:
            self.gate = nn.Linear(d_r, 1)
        # joint, twin: a learned offset of every position's score against the vocabulary's
        # logits, from `bias` (none without one)
        self.bias = None if bias is None or self.gated else nn.Parameter(torch.tensor(bias))
        if self.twin:
            self.q_twin = nn.Linear(d_r, d_r, bias=False)

    def rotated(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (K, N, d_r) rotated by its positions (K, N)."""
        cos, sin = rope_tables(positions, self.d, self.theta)
        return rotate(x, cos, sin)

    def forward(self, h, vocab_logits, rows, ids, lens, head, positions, twins) -> tuple:
        """One pass's parts: h (K, D, d_r), vocab_logits (K, D, V), rows (K, P, d_r) the
        decoder's projected rows, ids (K, P) the prompt; see `log_probs` and `nll`."""
        emb = head[ids]  # (K, P, d_base)
        prev = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, :-1]], dim=1)
        k, p = ids.shape
        key = self.rotated(self.k(rows) + self.tok(emb) + self.prev(prev),
                           torch.arange(p, device=ids.device).expand(k, -1))  # fmt: skip
        key = key.transpose(1, 2) / math.sqrt(self.d)  # (K, d_r, P)
        off = 0.0 if self.bias is None else self.bias

        def scores(q: nn.Linear) -> Tensor:  # (K, D, P), both sides rotated
            return self.rotated(q(h), positions) @ key + off

        valid = torch.arange(p, device=ids.device).view(1, 1, -1) < lens.view(-1, 1, 1)
        a = scores(self.q).masked_fill(~valid, NEG)
        if self.twin:
            tw = twins[ids]  # (K, P)
            b = scores(self.q_twin).masked_fill(~valid | (tw < 0)[:, None], NEG)
            a, ids = torch.cat([a, b], -1), torch.cat([ids, tw.clamp_min(0)], -1)
        if self.gated:
            return ("gate", vocab_logits, self.gate(h), a.softmax(-1), ids)
        return ("joint", vocab_logits, a, ids)


def log_probs(parts: tuple) -> Tensor:
    """The mixture's log-probabilities over the vocabulary (K, D, V)."""
    if parts[0] == "base":
        return parts[1].log_softmax(-1)
    if parts[0] == "gate":
        _, lv, g, attn, ids = parts
        copy = torch.zeros_like(lv).scatter_add(-1, ids[:, None].expand_as(attn), attn)
        mix = torch.sigmoid(g) * lv.softmax(-1) + torch.sigmoid(-g) * copy
        return mix.clamp_min(1e-30).log()
    _, lv, a, ids = parts
    lse = torch.logsumexp(torch.cat([lv, a], -1), -1, keepdim=True)
    copy = torch.zeros_like(lv).scatter_add(-1, ids[:, None].expand_as(a), (a - lse).exp())
    return ((lv - lse).exp() + copy).clamp_min(1e-30).log()


def nll(parts: tuple, tgt: Tensor, eos: int, eos_weight: float) -> Tensor:
    """`answer_loss` of the mixture, gathered at the targets (no (K, D, V) mixture built)."""
    if parts[0] == "base":
        return answer_loss(parts[1], tgt, eos, eos_weight)
    t = tgt.clamp_min(0)
    lv, ids = parts[1], parts[-1]
    hit = ids[:, None, :] == t[..., None]  # (K, D, P): the positions holding the target
    if parts[0] == "gate":
        g, attn = parts[2].squeeze(-1), parts[3]
        lvt = lv.log_softmax(-1).gather(-1, t[..., None]).squeeze(-1)
        ct = (attn * hit).sum(-1).clamp_min(1e-30).log()
        lp = torch.logaddexp(F.logsigmoid(g) + lvt, F.logsigmoid(-g) + ct)
    else:
        a = parts[2]
        lse = torch.logsumexp(torch.cat([lv, a], -1), -1)
        at = a.masked_fill(~hit, NEG)
        lp = torch.logsumexp(torch.cat([lv.gather(-1, t[..., None]), at], -1), -1) - lse
    w = torch.where(tgt == eos, eos_weight, 1.0) * (tgt != -100)
    return -(lp * w).sum() / w.sum().clamp_min(1.0)


def passes(dec: ReadoutDecoder, copy: CopyHead | None, batch: tuple, head: Tensor, twins) -> list:
    """Every pass's parts; a refinement reads the previous pass's mixture argmax."""
    rows, ids, lens, tgt = batch
    positions = torch.arange(tgt.shape[1], device=tgt.device).expand(tgt.shape[0], -1)
    c = dec.context(rows, lens)
    h0 = dec.pos_in(position_features(positions, dec.periods).to(c.lat.dtype))
    mask, rots = PrefixCausal(c.lat.shape[1]), dec._rotations(c, positions)
    cross = dec.row_cross if dec.cfg.row_attn else None
    h = dec.norm_out(dec._stack(dec.mixer, cross, h0, c, mask, "sdpa", rots))
    out: list[tuple] = []
    for i in range(1 + dec.cfg.refine):
        if i:
            with torch.no_grad():
                guess = log_probs(out[-1]).argmax(-1)
            x = h0 + dec.guess_in(head[guess]) + h
            ref_cross = dec.ref_cross if dec.cfg.row_attn else None
            h = dec.ref_norm(dec._stack(dec.ref_mixer, ref_cross, x, c, mask, "sdpa", rots))
        lv = dec.out(h) @ head.t()
        if copy is None:
            out.append(("base", lv))
        else:
            out.append(copy(h, lv, c.rows, ids, lens, head, positions, twins))
    return out


def load_records(path: Path, limit: int | None, max_answer: int, seed: int = 0) -> list[dict]:
    """The teacher's determined answers of at most `max_answer` tokens (EOS included)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["family"] in DETERMINED and len(r["answer_ids"]) <= max_answer]
    if limit:
        random.Random(seed).shuffle(recs)
        recs = recs[:limit]
    return recs


@torch.no_grad()
def capture_rows(base, recs: list[dict], lanes: int = 64) -> list[Tensor]:
    """Each record's rows (P, d_base) in float16, forwards of `lanes` prompts of like length."""
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["prompt_ids"]))
    out: list[Tensor] = [torch.empty(0)] * len(recs)
    for j in range(0, len(order), lanes):
        idx = order[j : j + lanes]
        ids = torch.zeros(len(idx), max(len(recs[i]["prompt_ids"]) for i in idx), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(recs[i]["prompt_ids"])] = torch.tensor(recs[i]["prompt_ids"])
        rows = capture(base, ids.to(base.device)).to("cpu", torch.float16)  # causal: no mask
        for r, i in enumerate(idx):
            out[i] = rows[r, : len(recs[i]["prompt_ids"])].clone()
    return out


def make_batch(recs: list[dict], rows: list[Tensor], idx: list[int], device="cpu") -> tuple:
    """(rows (K, P, d_base), prompt ids (K, P), lens (K,), targets (K, D), -100 past each)."""
    p = max(len(recs[i]["prompt_ids"]) for i in idx)
    d = max(len(recs[i]["answer_ids"]) for i in idx)
    r = torch.zeros(len(idx), p, rows[idx[0]].shape[1])
    ids = torch.zeros(len(idx), p, dtype=torch.long)
    tgt = torch.full((len(idx), d), -100, dtype=torch.long)
    lens = torch.tensor([len(recs[i]["prompt_ids"]) for i in idx])
    for j, i in enumerate(idx):
        n = len(recs[i]["prompt_ids"])
        r[j, :n], ids[j, :n] = rows[i].float(), torch.tensor(recs[i]["prompt_ids"])
        tgt[j, : len(recs[i]["answer_ids"])] = torch.tensor(recs[i]["answer_ids"])
    return tuple(t.to(device) for t in (r, ids, lens, tgt))


def greedy(answer: list[int], eos: int) -> list[int]:
    """A row of argmax tokens cut after its first EOS (the readout's answer)."""
    return answer[: answer.index(eos) + 1] if eos in answer else answer


@torch.no_grad()
def evaluate(dec, copy, held: tuple, head: Tensor, twins, eos: int) -> dict:
    """{family: {n, exact, token_agreement}} against the teacher's answers."""
    recs, rows = held
    dec.eval()
    by: dict[str, list] = {}
    for j in range(0, len(recs), 64):
        idx = list(range(j, min(j + 64, len(recs))))
        batch = make_batch(recs, rows, idx, head.device)
        pred = log_probs(passes(dec, copy, batch, head, twins)[-1])
        for b, i in enumerate(idx):
            want, got = recs[i]["answer_ids"], greedy(pred[b].argmax(-1).tolist(), eos)
            e = by.setdefault(recs[i]["family"], [0, 0, 0.0])
            e[0], e[1] = e[0] + 1, e[1] + (got == want)
            e[2] += sum(x == y for x, y in zip(got, want, strict=False)) / len(want)
    dec.train()
    return {f: {"n": n, "exact": round(x / n, 3), "token_agreement": round(a / n, 3)}
            for f, (n, x, a) in sorted(by.items())}  # fmt: skip


def train_arm(arm: str, data: dict, args, on_eval=None) -> list[dict]:
    """One arm from the same seed, batches and schedule as every other; its evaluations."""
    head, twins, eos = data["head"], data["twins"], data["eos"]
    torch.manual_seed(args.seed)
    cfg = ReadoutConfig(d_base=head.shape[1], vocab_size=head.shape[0], eos_token_id=eos,
                        **DECODER_CONFIG)  # fmt: skip
    dec = ReadoutDecoder(cfg).to(head.device)
    copy = None if arm == "base" else CopyHead(cfg.d_r, head.shape[1], arm, bias=args.copy_bias)
    copy = copy.to(head.device) if copy else None
    params = [*dec.parameters(), *(copy.parameters() if copy else [])]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    recs, rows = data["train"]
    # batches of like answer length: padding is most of a step's cost otherwise
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["answer_ids"]))
    buckets = [order[j : j + 8 * args.batch] for j in range(0, len(order), 8 * args.batch)]
    rng, log, t0 = random.Random(args.seed), [], time.perf_counter()
    for step in range(args.steps):
        bucket = rng.choice(buckets)
        idx = rng.sample(bucket, min(args.batch, len(bucket)))
        batch = make_batch(recs, rows, idx, head.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        outs = passes(dec, copy, batch, head, twins)
        loss = sum(nll(o, batch[3], eos, args.eos_weight) for o in outs) / len(outs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ev = evaluate(dec, copy, data["held"], head, twins, eos)
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "eval": ev,
                        "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
            print(json.dumps({"arm": arm, **log[-1]}), flush=True)
            if on_eval is not None:
                on_eval(log)
    return log


def load_data(args) -> dict:
    from transformers import AutoModelForCausalLM

    tuned = args.pair / "tuned"
    base = AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32).eval()
    base = base.to(args.device)
    vocab = json.loads((tuned / "tokenizer.json").read_text())["model"]["vocab"]
    data = {"head": lm_head_weight(base).detach().float(),
            "twins": space_twins(vocab).to(args.device), "eos": base.config.eos_token_id}  # fmt: skip
    for split, name, limit in (("train", "train", args.train), ("held", "heldout", None)):
        recs = load_records(args.pair / "teacher" / f"{name}.jsonl", limit, args.max_answer)
        data[split] = (recs, capture_rows(base, recs))
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--train", type=int, default=16000, help="train answers (0: all)")
    p.add_argument("--max-answer", type=int, default=48)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eos-weight", type=float, default=10.0)
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument(
        "--copy-bias",
        type=float,
        default=None,
        help="joint, twin: the position scores get a learned offset, starting here (default: none)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (rows stay in host memory)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = load_data(args)
    result = {"config": {k: str(v) for k, v in vars(args).items()},
              "rows_seconds": round(time.perf_counter() - t0, 1), "arms": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def save(arm: str, log: list[dict]) -> None:  # after every evaluation: a cut run keeps it
        result["arms"][arm] = log
        (args.out / "copy_ablation.json").write_text(json.dumps(result, indent=1))

    for arm in arms:
        save(arm, train_arm(arm, data, args, on_eval=functools.partial(save, arm)))


if __name__ == "__main__":
    main()
