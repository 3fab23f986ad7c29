"""The shipped reference base model: a small Llama trained autoregressively on the task suite.

It exists because nothing can be downloaded here: it is a real Hugging Face causal LM
(saved with `save_pretrained`, loaded with `from_pretrained(dir, local_files_only=True)`)
whose own greedy answers the readout decoder is distilled from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from stateblock.train import tasks
from stateblock.train.batching import budget_batches
from stateblock.train.tokenizer import save_tokenizer


@dataclass(frozen=True)
class BaseTrainConfig:
    steps: int = 6000
    n_examples: int = 200_000
    token_budget: int = 65536  # padded tokens per step
    lr: float = 2e-3
    max_batch: int = 256  # caps short-answer batches so short families get their share of steps
    warmup: int = 200
    seed: int = 0
    max_minutes: float = 0.0  # >0: shrink the step count to fit (decided at step 30, logged)


def llama_config(vocab_size: int, tok) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192 + 512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def encode_examples(tok, examples: list[tasks.Example]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with <bos>..<ans>, answer ids without EOS) per example."""
    prompts = tok([e.prompt for e in examples])["input_ids"]
    answers = tok([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    return list(zip(prompts, answers, strict=True))


def _collate(pairs, eos: int, pad: int, device):
    """Right-padded (ids, labels). No attention mask: under causal attention a right pad
    never reaches a real token, and without a mask SDPA can take its flash kernel."""
    seqs = [p + a + [eos] for p, a in pairs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, ((p, _a), s) in enumerate(zip(pairs, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, len(p) : len(s)] = torch.tensor(s[len(p) :])  # answer tokens and EOS only
    return ids.to(device), labels.to(device)


def fit_steps(planned: int, step: int, spent: float, pace: float, max_minutes: float) -> int:
    """The step count that fits a wall-clock budget: `spent` seconds so far, `pace` seconds a
    step measured after start-up. Re-planned once, before warm-up ends, so the cosine
    schedule still anneals."""
    if max_minutes <= 0 or pace <= 0:
        return planned
    return max(step + 1, min(planned, step + int((max_minutes * 60 - spent) / pace)))


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_base(out_dir: str | Path, cfg: BaseTrainConfig, device: str) -> dict:
    """Tokenizer + Llama trained on the suite, saved in bf16 to out_dir. Returns stats."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(64, tok)).to(device)
    model.train()
    examples = tasks.generate(cfg.n_examples, split="train", seed=cfg.seed)
    pairs = encode_examples(tok, examples)
    lengths = [len(p) + len(a) + 1 for p, a in pairs]
    batches = budget_batches(lengths, cfg.token_budget, max_batch=cfg.max_batch, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    t0 = time.perf_counter()
    steps = cfg.steps
    bar = tqdm(total=steps, desc="base", mininterval=5)
    step = 0
    while step < steps:
        if step == 10:
            t10 = time.perf_counter()
        if step == 80:
            now = time.perf_counter()
            steps = fit_steps(cfg.steps, step, now - t0, (now - t10) / 70, cfg.max_minutes)
            bar.total = steps
        ids, labels = _collate(
            [pairs[i] for i in batches[step % len(batches)]],
            tok.eos_token_id,
            tok.pad_token_id,
            device,
        )
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, cfg.lr, cfg.warmup)
        with amp:
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        step += 1
        bar.update(1)
    seconds = time.perf_counter() - t0
    # stored in bf16 to keep the shipped files small; every later stage loads these bytes
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    model.eval()
    return {
        "heldout_exact_by_family": ar_exact_by_family(model, tok, device),
        "steps": steps,
        "seconds": round(seconds, 1),
        "params": n_params,
        "final_loss": float(loss.item()),
        "device": device,
    }


@torch.no_grad()
def ar_exact_by_family(model, tok, device, n_each: int = 50, seed: int = 99) -> dict:
    """The base model's own greedy AR exact match vs the ground truth on held-out prompts,
    per family. Exact by construction: the greedy answer equals the truth iff one
    teacher-forced forward predicts every truth token and then EOS."""
    from stateblock.train.teacher import verify_candidates

    examples = tasks.per_family(n_each, split="heldout", seed=seed)
    pairs = encode_examples(tok, examples)
    max_new = max(len(a) for _, a in pairs) + 1
    agreed = verify_candidates(
        model, pairs, tok.eos_token_id, tok.pad_token_id, device, 65536, max_new
    )
    out: dict[str, list[int]] = {}
    for e, (_, a), got in zip(examples, pairs, agreed, strict=True):
        out.setdefault(e.family, []).append(int(got == a + [tok.eos_token_id]))
    return {f: round(sum(v) / len(v), 3) for f, v in out.items()}
