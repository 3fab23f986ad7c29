"""The reference base model's trainer: fresh task-suite prompts every step (loader worker
processes), bf16 autocast on the GPU, DistributedDataParallel under torchrun on every GPU of
a machine (or one GPU, or the CPU), a wall-clock budget with a cosine schedule planned from
the measured pace, resumable from its state file, and per-family held-out exact vs truth at
the end (teacher-forced: the greedy answer equals the truth iff argmax predicts every truth
token and then EOS).

    torchrun --standalone --nproc_per_node=2 -m stateblock.train.base_ddp --out DIR --minutes 6

With `--corpus DIR --tokenizer DIR` it trains a prose base instead (docs/CORPUS.md): random
windows of the corpus's tokenised train split, each document `<bos> ... <eos>`, the prose
tokenizer in the base directory, and the held-out split's perplexity at the end
(`prose_data.py`; `recipe.prose_base` has the shapes).

stateblock/train/recipe.py has the four runs that built models/reference/base (docs/QUALITY.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stateblock.train import prose_data, tasks
from stateblock.train.batching import budget_batches
from stateblock.train.ddp import (
    Plan,
    Ranks,
    data_parallel,
    ddp_parser,
    init_ranks,
    leave,
    loader,
    log,
    lr_at,
    ranks_agree,
)
from stateblock.train.tokenizer import save_tokenizer
from stateblock.train.weights import init_weights, read_state, restore, save_split, save_state


class FastEnc:
    """One-char-per-token encoding straight from the tokenizer's vocab (checked equal to the
    tokenizer at start-up): prompt -> [<bos>, keyword, chars..., <ans>], answer -> chars."""

    def __init__(self, tok_dir: str | Path) -> None:
        vocab = json.loads((Path(tok_dir) / "tokenizer.json").read_text())["model"]["vocab"]
        self.vocab = vocab
        self.bos, self.eos = vocab["<bos>"], vocab["<eos>"]
        self.pad, self.ans = vocab["<pad>"], vocab["<ans>"]
        self.char = {c: i for c, i in vocab.items() if len(c) == 1}

    def prompt(self, p: str) -> list[int]:
        kw, rest = p.split(":", 1)
        return [self.bos, self.vocab[kw + ":"]] + [self.char[c] for c in rest] + [self.ans]

    def answer(self, a: str) -> list[int]:
        return [self.char[c] for c in a]


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, tok_dir, seed, budget, max_batch, pool, weights):
        self.tok_dir, self.seed, self.budget, self.max_batch, self.pool = (
            tok_dir,
            seed,
            budget,
            max_batch,
            pool,
        )
        self.weights = weights

    def __iter__(self):
        enc = FastEnc(self.tok_dir)
        wi = torch.utils.data.get_worker_info()
        wid = wi.id if wi else 0
        it = 0
        while True:
            s = f"{self.seed}-{wid}-{it}"
            it += 1
            exs = tasks.generate(self.pool, split="train", seed=s, weights=self.weights)
            seqs, plens = [], []
            for e in exs:
                p = enc.prompt(e.prompt)
                seqs.append(p + enc.answer(e.answer) + [enc.eos])
                plens.append(len(p))
            for b in budget_batches(
                [len(x) for x in seqs], self.budget, max_batch=self.max_batch, seed=hash(s) & 0xFFFF
            ):
                w = max(len(seqs[i]) for i in b)
                ids = torch.full((len(b), w), enc.pad, dtype=torch.long)
                lab = torch.full((len(b), w), -100, dtype=torch.long)
                for r, i in enumerate(b):
                    x = torch.tensor(seqs[i])
                    ids[r, : len(x)] = x
                    lab[r, plens[i] - 1 : len(x) - 1] = x[
                        plens[i] :
                    ]  # shifted: position t predicts t+1
                yield ids, lab


def build_model(tok, a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=-(-len(tok) // 64) * 64 if a.corpus else 64,
        hidden_size=a.dim,
        intermediate_size=a.mlp_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_heads,
        max_position_embeddings=8192 + 512,
        rope_theta=a.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def exact_by_family(model, enc, device, n_each=50, seed=99, budget=65536):
    """Teacher-forced check: greedy answer == truth (+EOS) iff argmax predicts every truth
    token and then EOS. Returns per-family exact, per-bucket exact, and failure details."""
    from collections import defaultdict

    exs = tasks.per_family(n_each, split="heldout", seed=seed)
    seqs = [(enc.prompt(e.prompt), enc.answer(e.answer) + [enc.eos]) for e in exs]
    lens = [len(p) + len(t) for p, t in seqs]
    ok = [False] * len(exs)
    first_bad = [None] * len(exs)
    for b in budget_batches(lens, budget, max_batch=512):
        w = max(lens[i] for i in b)
        ids = torch.full((len(b), w), enc.pad, dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : lens[i]] = torch.tensor(seqs[i][0] + seqs[i][1])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
            pred = model(input_ids=ids.to(device)).logits.argmax(-1).cpu()
        for r, i in enumerate(b):
            p, t = seqs[i]
            got = pred[r, len(p) - 1 : len(p) - 1 + len(t)].tolist()
            bad = [k for k, (x, y) in enumerate(zip(got, t, strict=True)) if x != y]
            ok[i] = not bad
            first_bad[i] = bad[0] if bad else None
    fam, buck = defaultdict(list), defaultdict(list)
    tokacc = defaultdict(list)
    for e, o, fb, (_, t) in zip(exs, ok, first_bad, seqs, strict=True):
        fam[e.family].append(o)
        n = len(e.answer)
        buck[tasks.bucket_of(n)].append(o)
        tokacc[e.family].append((fb if fb is not None else len(t)) / len(t))
    r = lambda v: round(sum(v) / len(v), 3)  # noqa: E731
    return {
        "family": {f: r(v) for f, v in fam.items()},
        "bucket": {b: (r(v), len(v)) for b, v in sorted(buck.items())},
        "prefix_frac": {f: r(v) for f, v in tokacc.items()},
    }


SHAPE = {"dim": 256, "mlp_dim": 1024, "n_layers": 8, "n_heads": 8}  # the task base's default
SHAPE_HELP = {"dim": "hidden size", "mlp_dim": "MLP width", "n_layers": "transformer layers",
              "n_heads": "attention heads"}  # fmt: skip


def add_shape_args(ap: argparse.ArgumentParser, defaults: dict[str, int] | None = None) -> None:
    """The base model's shape: --dim, --mlp-dim, --n-layers, --n-heads (each from `defaults`,
    else unset) and --rope-theta; the task trainer and the prose stage take the same."""
    for name, help_ in SHAPE_HELP.items():
        default = (defaults or {}).get(name)
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=help_)
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    batch = (512, "sequences a batch, per GPU")
    ap = ddp_parser(
        "stateblock.train.base_ddp", __doc__, minutes=7.0, batch=batch, lr=2e-3, warmup=150
    )
    add = ap.add_argument
    add("--out", required=True, help="writes OUT/base (the model) and OUT/fp32.part* (resume)")
    add_shape_args(ap, SHAPE)
    add(
        "--init", default="",
        help="start from (no optimizer): an fp32 split checkpoint prefix or a saved base dir",
    )  # fmt: skip
    add("--state", default="", help="full resumable state file (model+opt+step), used if it exists")
    add("--eval-each", type=int, default=50, help="held-out prompts a family, seed 99, at the end")
    add("--final-eval-each", type=int, default=30, help="the same at seed 1234 (0: skip)")
    add("--corpus", default="", help="prose: train on this corpus dir, not the task suite")
    add("--tokenizer", default="", help="prose: the tokenizer dir (prose_tokenizer.py)")
    add("--seq-len", type=int, default=512, help="prose: tokens a training window")
    add("--eval-tokens", type=int, default=0, help="prose: held-out tokens scored (0: all)")
    a = ap.parse_args(argv)
    if bool(a.corpus) != bool(a.tokenizer):
        ap.error("--corpus and --tokenizer go together (a prose base)")
    return a


def setup_tokenizer(a: argparse.Namespace, r: Ranks, tok_dir: Path):
    """The base directory's tokenizer, loaded: the reference one with its fast encoder
    (checked equal to it), or with --corpus the prose tokenizer, `enc` None, and the
    corpus's splits tokenised once by rank 0 (`prose_data.encode_split`)."""
    from transformers import AutoTokenizer

    if r.rank == 0:
        if a.corpus:
            prose_data.copy_tokenizer(a.tokenizer, tok_dir)
            tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
            for split in ("train", "heldout"):
                prose_data.encode_split(tok, Path(a.corpus) / f"{split}.txt", tok_dir)
        else:
            save_tokenizer(tok_dir)
    if r.ddp:
        dist.barrier()
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    if a.corpus:
        return tok, None
    enc = FastEnc(tok_dir)
    # the fast encoder must equal the tokenizer
    for e in tasks.generate(200, split="heldout", seed=5):
        assert tok(e.prompt)["input_ids"] == enc.prompt(e.prompt), e.prompt
        assert tok(e.answer, add_special_tokens=False)["input_ids"] == enc.answer(e.answer)
    return tok, enc


def training_stream(a: argparse.Namespace, tok_dir: Path, seed: str):
    """Fresh task-suite prompts, or with --corpus random windows of the train split."""
    if a.corpus:
        ids = prose_data.ids_path(Path(a.corpus) / "train.txt", tok_dir)
        batch = max(1, min(a.max_batch, a.budget // a.seq_len))
        return prose_data.TextWindows(ids, a.seq_len, batch, seed)
    weights = json.loads(a.weights)
    return Stream(str(tok_dir), seed, a.budget, a.max_batch, a.pool, weights)


def evaluate(a: argparse.Namespace, model, enc, device, tok_dir: Path) -> dict:
    """Held-out figures: per-family exact vs truth (seeds 99 and 1234), or with --corpus the
    held-out split's perplexity."""
    if a.corpus:
        ids = torch.load(prose_data.ids_path(Path(a.corpus) / "heldout.txt", tok_dir), mmap=True)
        return {"heldout": prose_data.heldout_loss(model, ids, a.seq_len, device, a.eval_tokens)}
    stats = {"heldout99": exact_by_family(model, enc, device, n_each=a.eval_each, seed=99)}
    if a.final_eval_each:
        stats["heldout1234"] = exact_by_family(
            model, enc, device, n_each=a.final_eval_each, seed=1234
        )
    return stats


def resume(a: argparse.Namespace, model, opt, device) -> tuple[int, int | None]:
    """The step and planned total of the run `a.state` saved (0, None: a fresh run), its
    model and optimizer state loaded; --reschedule plans the total anew."""
    saved = read_state(a.state, device)
    if saved is None:
        return 0, None
    st = restore(saved, {"model": model, "opt": opt})
    step, total = st["step"], st["total"]
    log(f"resumed state at step {step}/{total}")
    return step, None if a.reschedule else total


def save(a: argparse.Namespace, model, opt, step: int, total: int | None, out: Path) -> None:
    """OUT/fp32.part* (fp32 weights), the resume state when asked, and OUT/base (bf16)."""
    model.eval()
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    save_split(sd, out / "fp32")
    if a.state:
        save_state(a.state, {"model": model, "opt": opt}, step=step, total=total)
    model.to(torch.bfloat16).save_pretrained(str(out / "base"), safe_serialization=True)
    model.float()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    r = init_ranks(a.device)
    rank, world, device = r.rank, r.world, r.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "base"
    tok, enc = setup_tokenizer(a, r, tok_dir)
    torch.manual_seed(a.seed)
    model = build_model(tok, a)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params} ({n_params * 2 / 1e6:.1f} MB bf16)")
    if a.init:
        model.load_state_dict(init_weights(Path(a.init)))
        log("init from", a.init)
    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95), fused=a.device == "cuda"
    )
    step, total = resume(a, model, opt, device)
    dmodel = data_parallel(model, r)
    dl = loader(training_stream(a, tok_dir, f"{a.seed}-{rank}-{step}"), a.workers)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.device == "cuda")
    start = step
    fallback = a.max_steps if a.max_steps < 10**9 else 4000
    plan = Plan(r, start, total, a.minutes, a.max_steps, fallback)
    for ids, lab in dl:
        steps = plan.steps(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step - start, steps - start, a.lr, a.warmup)
        ids, lab = ids.to(device, non_blocking=True), lab.to(device, non_blocking=True)
        with amp:
            logits = dmodel(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), lab.flatten(), ignore_index=-100
        )
        step += 1
        plan.update(opt, model.parameters(), loss, step, f"shape {tuple(ids.shape)}")
        if plan.done(step):
            break
    train_s = time.perf_counter() - plan.t0
    total, losses = plan.total, plan.losses
    stats = {
        "steps": step,
        "steps_this_run": step - start,
        "train_seconds": round(train_s, 1),
        "params": n_params,
        "final_loss": losses[-1] if losses else None,
        "world": world,
        "ranks_agree": ranks_agree(model, r),
        "args": vars(a),
    }
    if rank == 0:
        save(a, model, opt, step, total, out)
        t1 = time.perf_counter()
        stats.update(evaluate(a, model, enc, device, tok_dir))
        stats["eval_seconds"] = round(time.perf_counter() - t1, 1)
        log(json.dumps(stats))
        (out / "base_stats.json").write_text(json.dumps(stats, indent=2))
    leave(r)


if __name__ == "__main__":
    main()
