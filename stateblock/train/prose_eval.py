"""Held-out figures of a prose base (`prose_stage.py`): the next-token loss over the whole
held-out stream in bits per byte and per word of its text, and greedy continuations of
held-out passages with their distinct-4 (a base that loops repeats its 4-grams).

The stream is scored in consecutive windows of `seq_len` tokens, so every token but the first
is predicted once, with what precedes it in its window as context. A label that is `<bos>`
(the start of the next document, given, not text) is not scored; each document's `<eos>` is:
the loss per byte is the cost of a document's text and of its end, over its UTF-8 bytes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def score(model, ids: torch.Tensor, seq_len: int, bos: int, batch: int = 64) -> tuple[float, int]:
    """(summed next-token loss in nats, tokens scored) over the id stream `ids`."""
    n = len(ids) - 1
    x = F.pad(ids[:n], (0, -n % seq_len)).view(-1, seq_len).long()
    y = F.pad(ids[1:], (0, -n % seq_len), value=bos).view(-1, seq_len).long()
    y = y.masked_fill(y == bos, -100)
    total = torch.zeros((), dtype=torch.float64, device=ids.device)
    for k in range(0, len(x), batch):
        with _autocast(ids.device):
            logits = model(input_ids=x[k : k + batch]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y[k : k + batch].flatten(),
                                 ignore_index=-100, reduction="sum")  # fmt: skip
    return total.item(), int((y != -100).sum())


def figures(nll_sum: float, tokens: int, split_meta: dict) -> dict:
    """Loss per token (nats), perplexity, and bits per byte and per word of the text."""
    nll = nll_sum / max(1, tokens)
    bits = nll_sum / math.log(2)
    return {
        "tokens": tokens,
        "nll": round(nll, 4),
        "perplexity": round(math.exp(min(nll, 50.0)), 2),
        "bits_per_byte": round(bits / split_meta["bytes"], 4),
        "bits_per_word": round(bits / split_meta["words"], 3),
    }


def passages(ids: torch.Tensor, bos: int, n: int, length: int) -> torch.Tensor:
    """The first `length` tokens (from `<bos>`) of the first `n` documents at least that long."""
    starts = (ids == bos).nonzero().flatten().tolist() + [len(ids)]
    keep = [s for s, e in zip(starts, starts[1:], strict=False) if e - s >= length][:n]
    if not keep:
        return torch.empty((0, length), dtype=torch.long, device=ids.device)
    return torch.stack([ids[s : s + length] for s in keep]).long()


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new: int, eos: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `new` tokens at most, cut after its `<eos>`
    (the whole prefix re-read every token: the prompts are few and short)."""
    x = prompts
    for _ in range(new):
        with _autocast(x.device):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], dim=1)
    out = []
    for row in x[:, prompts.shape[1] :].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def distinct(seqs: list[list[int]], n: int = 4) -> float | None:
    """Distinct n-grams over all n-grams of `seqs` (None: no sequence has n tokens)."""
    grams = [tuple(s[i : i + n]) for s in seqs for i in range(len(s) - n + 1)]
    return round(len(set(grams)) / len(grams), 4) if grams else None


def continuations(model, ids: torch.Tensor, bos: int, eos: int, tok, n: int,
                  prompt_len: int = 32, new: int = 64) -> dict:  # fmt: skip
    """Greedy continuations of `n` held-out passages: distinct-4 of the base's and of the
    text's own next `new` tokens, and the first three as text."""
    both = passages(ids, bos, n, prompt_len + new)
    if not len(both):
        return {"n": 0}
    prompts, truth = both[:, :prompt_len], both[:, prompt_len:].tolist()
    model.eval()
    got = greedy(model, prompts, new, eos)
    shown = [{"prompt": tok.decode(p, skip_special_tokens=True),
              "base": tok.decode(g, skip_special_tokens=False)}
             for p, g in zip(prompts.tolist()[:3], got[:3], strict=True)]  # fmt: skip
    return {
        "n": len(got),
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "distinct4": distinct(got),
        "distinct4_text": distinct(truth),
        "ended_with_eos": sum(bool(g) and g[-1] == eos for g in got),
        "shown": shown,
    }
