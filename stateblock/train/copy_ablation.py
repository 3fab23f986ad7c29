"""The copy-head ablation (issue 41): a readout that can point at the prompt's tokens against
one that must spell every answer token through the base's lm_head.

Three of the four determined prose families copy a span of the prompt (repeat, next_sentence,
question), and the readout copies badly: it reaches a prompt token only through a captured
row, whose final hidden state is the base's guess at the token after it. The arms are the
decoder without a copy head (`base`), with rows that also carry their own tokens (`tokens`:
ReadoutConfig.row_tokens), and with each of `stateblock.model.copy_head`'s mixtures (gate,
joint, twin, gatetwin; that module says what each mixes).

Arms train the shipped decoder shape (`recipe.DECODER_CONFIG`) on the same rows, batches and
steps (on the CPU, or --device cuda): the rows of a pair's tuned base for its teacher's determined answers (up
to --max-answer tokens), captured once. Held-out exact match and token agreement with the
teacher, by family, at every --eval-every steps:

    python -m stateblock.train.copy_ablation --pair DIR --out OUT [--arms base,twin,...]
        [--train 16000] [--steps 800] [--threads 2]

DIR holds `tuned/` (the base, tokenizer beside) and `teacher/{train,heldout}.jsonl`
(`prose_readout`'s work folder). docs/QUALITY.md has the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from stateblock.model.capture import lm_head_weight
from stateblock.model.copy_head import MODES as COPY_MODES
from stateblock.model.copy_head import log_probs, space_twins
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.pointer import capture_pointing
from stateblock.train.ddp import lr_at
from stateblock.train.distill import bonuses, param_groups
from stateblock.train.prose_tasks import DETERMINED
from stateblock.train.readout_ddp import parts_loss
from stateblock.train.recipe import DECODER_CONFIG

# tokens: row_tokens, no copy head; MODE+guess: that copy head with the base's top-4 first
# tokens among its candidates (ReadoutConfig.copy_guess); +follow: its refinement follows the
# previous pass's tokens (ReadoutConfig.copy_follow); +span: its vote on a copied span's start
# (ReadoutConfig.copy_span); +match: a bonus by the prompt's repeated runs before a span's
# start (ReadoutConfig.copy_match, runs up to MATCH), +ends: and their own for runs that stop
# there (ReadoutConfig.copy_match_ends); +point: a mix of the base's attention maps from the
# prompt's last position, every layer's heads (ReadoutConfig.copy_point); +ref2: two
# refinement passes, not one
ARMS = ("base", "tokens", *COPY_MODES, *(f"{m}+guess" for m in COPY_MODES),
        *(f"{m}+guess+follow" for m in COPY_MODES), "twin+follow", "twin+guess+span",
        "twin+guess+follow+span", "twin+guess+follow+ref2", "twin+guess+match",
        "twin+guess+match+follow", "twin+guess+match+follow+span",
        "twin+guess+match+ends+follow+span", "twin+guess+point+follow+span",
        "twin+guess+match+point+follow+span")  # fmt: skip
GUESS, MATCH = 4, 16
FLAGS = ("guess", "follow", "span", "match", "ends", "point", "ref2")


def valid_arm(arm: str) -> bool:
    """`base`, `tokens`, or a copy mode with flags (each once; `ends` with `match`, `follow`
    and `span` need the refinement pass every shape here has)."""
    mode, *flags = arm.split("+")
    if mode in ("base", "tokens"):
        return not flags
    ok = mode in COPY_MODES and set(flags) <= set(FLAGS) and len(set(flags)) == len(flags)
    return ok and ("ends" not in flags or "match" in flags)


def new_decoder(arm: str, head: Tensor, twins: Tensor, eos: int, bias: float | None, maps: int = 0):
    """The shipped decoder's shape with the arm's copy head (none for `base` and `tokens`;
    `tokens` gives every row its own token instead: ReadoutConfig.row_tokens)."""
    mode, *flags = arm.split("+")
    shape = {**DECODER_CONFIG, "refine": 2} if "ref2" in flags else DECODER_CONFIG
    cfg = ReadoutConfig(d_base=head.shape[1], vocab_size=head.shape[0], eos_token_id=eos,
                        **shape, copy="" if arm in ("base", "tokens") else mode,
                        row_tokens=arm == "tokens", copy_guess=GUESS if "guess" in flags else 0,
                        copy_follow="follow" in flags, copy_span="span" in flags,
                        copy_match=MATCH if "match" in flags else 0,
                        copy_match_ends="ends" in flags,
                        copy_point=maps if "point" in flags else 0)  # fmt: skip
    dec = ReadoutDecoder(cfg)
    if cfg.copy:
        dec.twins.copy_(twins)
        if bias is not None and not dec.copy_head.gated:  # a learned offset of the scores
            dec.copy_head.bias = nn.Parameter(torch.tensor(bias))
    return dec.to(head.device)


def passes(dec: ReadoutDecoder, batch: tuple, head: Tensor) -> list[tuple]:
    rows, ids, lens, tgt, point = batch
    positions = torch.arange(tgt.shape[1], device=tgt.device).expand(tgt.shape[0], -1)
    return dec.pass_parts(rows, lens, positions, head, ids, point if dec.cfg.copy_point else None)


def load_records(path: Path, limit: int | None, max_answer: int, seed: int = 0) -> list[dict]:
    """The teacher's determined answers of at most `max_answer` tokens (EOS included)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["family"] in DETERMINED and len(r["answer_ids"]) <= max_answer]
    if limit:
        random.Random(seed).shuffle(recs)
        recs = recs[:limit]
    return recs


@torch.no_grad()
def capture_rows(
    base, recs: list[dict], lanes: int = 64, point: bool = False
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Each record's rows (P, d_base) in float16, forwards of `lanes` prompts of like length;
    with `point`, also its attention maps from its prompt's last position (L * H, P) in
    float16 (`pointer.capture_pointing`), else None."""
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["prompt_ids"]))
    out: list[Tensor] = [torch.empty(0)] * len(recs)
    maps: list[Tensor] = [torch.empty(0)] * len(recs)
    for j in range(0, len(order), lanes):
        idx = order[j : j + lanes]
        lens = torch.tensor([len(recs[i]["prompt_ids"]) for i in idx])
        ids = torch.zeros(len(idx), int(lens.max()), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : lens[r]] = torch.tensor(recs[i]["prompt_ids"])
        # causal: right padding needs no mask
        rows, att = capture_pointing(base, ids.to(base.device), lens.to(base.device), maps=point)
        rows = rows.to("cpu", torch.float16)
        for r, i in enumerate(idx):
            out[i] = rows[r, : lens[r]].clone()
            if att is not None:
                maps[i] = att[r, :, : lens[r]].to("cpu", torch.float16)
    return out, maps if point else None


def make_batch(recs: list[dict], rows: list[Tensor], idx: list[int], device="cpu",
               maps: list[Tensor] | None = None) -> tuple:  # fmt: skip
    """(rows (K, P, d_base), prompt ids (K, P), lens (K,), targets (K, D), -100 past each,
    the base's attention maps (K, A, P) or None)."""
    p = max(len(recs[i]["prompt_ids"]) for i in idx)
    d = max(len(recs[i]["answer_ids"]) for i in idx)
    r = torch.zeros(len(idx), p, rows[idx[0]].shape[1])
    ids = torch.zeros(len(idx), p, dtype=torch.long)
    tgt = torch.full((len(idx), d), -100, dtype=torch.long)
    lens = torch.tensor([len(recs[i]["prompt_ids"]) for i in idx])
    point = None if maps is None else torch.zeros(len(idx), maps[idx[0]].shape[0], p)
    for j, i in enumerate(idx):
        n = len(recs[i]["prompt_ids"])
        r[j, :n], ids[j, :n] = rows[i].float(), torch.tensor(recs[i]["prompt_ids"])
        tgt[j, : len(recs[i]["answer_ids"])] = torch.tensor(recs[i]["answer_ids"])
        if point is not None:
            point[j, :, :n] = maps[i].float()
    out = tuple(t.to(device) for t in (r, ids, lens, tgt))
    return (*out, None if point is None else point.to(device))


def greedy(answer: list[int], eos: int) -> list[int]:
    """A row of argmax tokens cut after its first EOS (the readout's answer)."""
    return answer[: answer.index(eos) + 1] if eos in answer else answer


MISSES = ("start", "early", "late", "end")


def first_miss(got: list[int], want: list[int], eos: int) -> str | None:
    """Where an answer first departs from the teacher's: None (it does not), `end` (there
    one of them stops), `start` (its first token), `early` (tokens 1-7) or `late`."""
    for t, (x, y) in enumerate(zip(got, want, strict=False)):
        if x != y:
            return "end" if eos in (x, y) else "start" if t == 0 else "early" if t < 8 else "late"
    return None if len(got) == len(want) else "end"


@torch.no_grad()
def evaluate(dec: ReadoutDecoder, held: tuple, head: Tensor, eos: int) -> dict:
    """{family: {n, exact, token_agreement, first_miss: {where: share of answers}}} against
    the teacher's answers (`first_miss`: where the answers that differ first do)."""
    recs, rows, maps = held
    dec.eval()
    by: dict[str, list] = {}
    for j in range(0, len(recs), 64):
        idx = list(range(j, min(j + 64, len(recs))))
        batch = make_batch(recs, rows, idx, head.device, maps)
        pred = log_probs(passes(dec, batch, head)[-1])
        for b, i in enumerate(idx):
            want, got = recs[i]["answer_ids"], greedy(pred[b].argmax(-1).tolist(), eos)
            e = by.setdefault(recs[i]["family"], [0, 0, 0.0, dict.fromkeys(MISSES, 0)])
            e[0], e[1] = e[0] + 1, e[1] + (got == want)
            e[2] += sum(x == y for x, y in zip(got, want, strict=False)) / len(want)
            if (miss := first_miss(got, want, eos)) is not None:
                e[3][miss] += 1
    dec.train()
    return {f: {"n": n, "exact": round(x / n, 3), "token_agreement": round(a / n, 3),
                "first_miss": {w: round(c / n, 3) for w, c in m.items()}}
            for f, (n, x, a, m) in sorted(by.items())}  # fmt: skip


def train_arm(arm: str, data: dict, args, on_eval=None) -> list[dict]:
    """One arm from the same seed, batches and schedule as every other; its evaluations."""
    head, twins, eos = data["head"], data["twins"], data["eos"]
    torch.manual_seed(args.seed)
    recs, rows, maps = data["train"]
    dec = new_decoder(arm, head, twins, eos, args.copy_bias, 0 if maps is None else len(maps[0]))
    params = list(dec.parameters())
    opt = torch.optim.AdamW(param_groups(dec, args.bonus_lr), lr=args.lr, weight_decay=0.01,
                            betas=(0.9, 0.95))  # fmt: skip
    # batches of like answer length: padding is most of a step's cost otherwise
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["answer_ids"]))
    buckets = [order[j : j + 8 * args.batch] for j in range(0, len(order), 8 * args.batch)]
    rng, log, t0 = random.Random(args.seed), [], time.perf_counter()
    for step in range(args.steps):
        bucket = rng.choice(buckets)
        idx = rng.sample(bucket, min(args.batch, len(bucket)))
        batch = make_batch(recs, rows, idx, head.device, maps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup) * g["lr_scale"]
        outs = passes(dec, batch, head)
        loss = sum(parts_loss(o, batch[3], eos, args.eos_weight) for o in outs) / len(outs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ev = evaluate(dec, data["held"], head, eos)
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "eval": ev,
                        "bonuses": bonuses(dec),
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
    point = any("point" in a.split("+") for a in args.arms.split(","))
    for split, name, limit in (("train", "train", args.train), ("held", "heldout", None)):
        recs = load_records(args.pair / "teacher" / f"{name}.jsonl", limit, args.max_answer)
        data[split] = (recs, *capture_rows(base, recs, point=point))
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
    p.add_argument("--bonus-lr", type=float, default=1.0,
                   help="the copy head's bonuses learn at this multiple of the rate")  # fmt: skip
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
    if unknown := [a for a in arms if not valid_arm(a)]:
        p.error(f"unknown arms {unknown}: a copy mode {COPY_MODES} joined by + to any of "
                f"{FLAGS}, or base, or tokens (e.g. {ARMS[-1]})")  # fmt: skip
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
