"""The distillation teacher: the base model's own greedy autoregressive answer to each prompt.

Computed exactly, but cheaply. Greedy decoding emits argmax(next | prefix) at every step,
so when a single teacher-forced forward over (prompt + a candidate answer + EOS) predicts
every candidate token and then EOS, the greedy answer *is* that candidate (by induction
over the steps). The suite's ground truth is that candidate; only prompts where the model
deviates are decoded step by step, from the first deviation on. The one caveat: a
full-sequence forward and an incremental KV-cache decode may round differently, which can
flip an exact near-tie (tested equal to `generate` on the reference model).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import torch
from tqdm import tqdm

from stateblock.train.batching import budget_batches


@torch.no_grad()
def verify_candidates(
    model,
    pairs: list[tuple[list[int], list[int]]],
    eos: int,
    pad: int,
    device,
    budget: int,
    max_new: int,
) -> list[list[int]]:
    """Per pair, the greedy prefix agreed with the candidate: (candidate + [EOS])[:max_new]
    when all agree, else the agreed tokens plus the model's own token at the first deviation."""
    out: list[list[int]] = [[] for _ in pairs]
    targets = [(a + [eos])[:max_new] for _, a in pairs]
    lengths = [len(p) + len(t) for (p, _), t in zip(pairs, targets, strict=True)]
    for batch in tqdm(budget_batches(lengths, budget), desc="teacher verify", mininterval=5):
        width = max(lengths[i] for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = torch.tensor(pairs[i][0] + targets[i])
            mask[r, : lengths[i]] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        pred = logits.argmax(-1).cpu()  # (B, W): pred[t] is the greedy token after ids[:t+1]
        for r, i in enumerate(batch):
            p, target = pairs[i][0], targets[i]
            got = pred[r, len(p) - 1 : len(p) - 1 + len(target)].tolist()
            j = next((k for k, (x, y) in enumerate(zip(got, target, strict=True)) if x != y), None)
            out[i] = target if j is None else target[:j] + [got[j]]
    return out


@torch.no_grad()
def greedy_continue(
    model, prefixes: list[list[int]], max_new: int, eos: int, pad: int, device, on_step=None
) -> list[list[int]]:
    """Plain batched greedy decoding with a KV cache (left-padded); returns new tokens,
    ending with EOS when one was emitted within max_new."""
    width = max(len(s) for s in prefixes)
    ids = torch.full((len(prefixes), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(prefixes):
        ids[r, width - len(s) :] = torch.tensor(s)
        mask[r, width - len(s) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    past, nxt = _cache_of(res), res.logits[:, -1].argmax(-1)
    cache_arg = _cache_argument(model)
    new: list[list[int]] = [[] for _ in prefixes]
    done = [False] * len(prefixes)  # host-side: one device sync a step, not one a lane
    last = pos[:, -1]
    for _ in range(max_new):
        if on_step is not None:
            on_step()
        for r, t in enumerate(nxt.tolist()):
            if not done[r]:
                new[r].append(t)
                done[r] = t == eos
        if all(done):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last = last + 1
        res = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            use_cache=True,
            **{cache_arg: past},
        )
        past, nxt = _cache_of(res), res.logits[:, -1].argmax(-1)
    return new


def _cache_argument(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x; the old name warns of its
    removal); the GPU image's release may still have the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def greedy_answers(
    model,
    pairs,
    *,
    eos: int,
    pad: int,
    max_new: int,
    device,
    budget: int = 65536,
    decode_budget: int | None = None,
    decode_limit: int | None = None,
) -> list[list[int] | None]:
    """The base model's greedy answer (with EOS if emitted within max_new) for every pair
    of (prompt ids, candidate answer ids).

    decode_limit caps how many prompts are decoded step by step (the model deviated from
    the candidate); the others come back as None, and the caller says how many it dropped.
    """
    agreed: list = verify_candidates(model, pairs, eos, pad, device, budget, max_new)
    todo = [i for i, a in enumerate(agreed) if a[-1] != eos and len(a) < max_new]
    todo.sort(key=lambda i: len(pairs[i][1]))  # under a limit, decode the cheap ones first
    if decode_limit is not None and len(todo) > decode_limit:
        for i in todo[decode_limit:]:
            agreed[i] = None
        todo = todo[:decode_limit]
    lengths = [len(pairs[i][0]) + max_new for i in todo]
    step_budget = decode_budget or budget * 4
    batches = budget_batches(lengths, step_budget)
    rests = [max_new - min(len(agreed[todo[k]]) for k in batch) for batch in batches]
    # in decode steps, so the bar moves on every step of a long answer, not once a batch
    bar = tqdm(total=sum(rests), desc="teacher decode", unit="step", mininterval=5)
    for batch, rest in zip(batches, rests, strict=True):
        prefixes = [pairs[todo[k]][0] + agreed[todo[k]] for k in batch]
        before = bar.n
        out = greedy_continue(model, prefixes, rest, eos, pad, device, on_step=lambda: bar.update())
        bar.update(rest - (bar.n - before))  # a batch that stopped early: its unused steps
        for k, extra in zip(batch, out, strict=True):
            i = todo[k]
            agreed[i] = agreed[i] + extra
    bar.close()
    return [None if a is None else a[:max_new] for a in agreed]


def save_cache(path: str | Path, records: list[dict]) -> str:
    """Writes JSONL records and returns the SHA-256 of the file: the data digest."""
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def load_cache(path: str | Path) -> tuple[list[dict], str]:
    data = Path(path).read_bytes()
    return [json.loads(line) for line in data.splitlines() if line], hashlib.sha256(
        data
    ).hexdigest()
