"""Does the base know where its answer's copied span starts? For each family, the share of
held-out prompts whose teacher answer starts where a head's attention from the prompt's last
position peaks (`stateblock.model.pointer`), for every layer and head (docs/QUALITY.md):

    python -m stateblock.train.pointer_probe --pair DIR [--n 60]

DIR holds `tuned/` and `teacher/heldout.jsonl` (`prose_readout`'s work folder). The start
is where the answer's tokens 1-3 occur once in the prompt, less one (its first token may be
spelt without the passage's leading space); prompts without such a place are not counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from stateblock.model.pointer import capture_pointing


def span_start(prompt: list[int], answer: list[int]) -> int | None:
    """Where a copied answer starts in its prompt, or None: its tokens 1-3 (EOS dropped) occur
    once in the prompt, and not at its very start."""
    want = answer[1:4]
    if len(want) < 3:
        return None
    at = [s for s in range(1, len(prompt) - 2) if prompt[s : s + 3] == want]
    return at[0] - 1 if len(at) == 1 else None


@torch.no_grad()
def probe(base, records: list[dict]) -> tuple[torch.Tensor, int]:
    """(L * H,) the share of records whose start each head's map peaks at, and their count."""
    hits, n = None, 0
    for r in records:
        s = span_start(r["prompt_ids"], r["answer_ids"][:-1])
        if s is None:
            continue
        ids = torch.tensor([r["prompt_ids"]], device=base.device)
        _, maps = capture_pointing(base, ids, torch.tensor([ids.shape[1]], device=base.device))
        h = (maps[0].argmax(-1) == s).float().cpu()
        hits, n = (h if hits is None else hits + h), n + 1
    return (hits / n if n else torch.zeros(0)), n


def main() -> None:
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, required=True)
    p.add_argument("--n", type=int, default=60, help="held-out prompts a family")
    a = p.parse_args()
    base = AutoModelForCausalLM.from_pretrained(a.pair / "tuned", dtype=torch.float32).eval()
    heads = base.config.num_attention_heads
    by: dict[str, list[dict]] = {}
    for line in (a.pair / "teacher" / "heldout.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by.setdefault(r["family"], []).append(r)
    for family, recs in sorted(by.items()):
        share, n = probe(base, recs[: a.n])
        if n:
            best = int(share.argmax())
            print(json.dumps({"family": family, "found": n, "best": f"L{best // heads}H{best % heads}",
                              "share": round(float(share[best]), 3),
                              "by_head": [round(float(x), 2) for x in share]}))  # fmt: skip


if __name__ == "__main__":
    main()
