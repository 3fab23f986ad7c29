"""Fidelity through the served API on prompts this script draws itself
(`python -m bench.api_fidelity`), not `tasks.generate`'s: the suite's formats with other
distributions (both `add` operands five digits wide, `repeat` of one letter, counts at
chosen lengths), so a recipe tuned to the eval seed or to the generator shows.

The embedded stack (nats-server, capture, readout workers, gateway) answers each prompt at
temperature 0 through the official `openai` client; the teacher is transformers' own greedy
`generate` on the same base; the truth is `tasks.solve`. Reports exact match and token
agreement against the teacher, by answer-length bucket and by family, and every miss.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.latency_cpu import embedded_stack
from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER
from stateblock.train.tasks import LETTERS, _alpha, bucket_of, solve


def draw(seed: int, scale: int = 1) -> list[str]:
    """`scale` x 63 prompts of all nine families, from this script's own random draws."""
    rng = random.Random(seed)

    def w(lo: int, hi: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))

    out: list[str] = []
    for _ in range(scale):
        out += [f"copy: {w(1, 40)}" for _ in range(8)]
        out += [f"copy: {w(65, 250)}" for _ in range(4)] + [
            f"copy: {w(260, 700)}" for _ in range(3)
        ]
        out += [f"reverse: {w(1, 32)}" for _ in range(8)] + [f"sort: {w(1, 32)}" for _ in range(8)]
        out += [f"add: {rng.randint(0, 99999):05d}+{rng.randint(0, 99999):05d}" for _ in range(8)]
        for _ in range(8):
            keys = rng.sample(LETTERS, rng.randint(2, 10))
            pairs = ";".join(f"{k}={rng.randint(0, 999)}" for k in keys)
            out.append(f"recall: {pairs} ?{rng.choice(keys)}")
        for n in (5, 30, 120, 400):
            a = rng.randint(0, 999 - n)
            out += [f"count: {a:03d} {a + n - 1:03d}", f"countdown: {a + n - 1:03d} {a:03d}"]
        out += [f"repeat: {w(1, 5)} {n:03d}" for n in (4, 20, 90, 200)]
        for n in (5, 40, 150, 500):
            a = rng.randint(0, 17575 - n)
            out.append(f"alpha: {_alpha(a)} {_alpha(a + n - 1)}")
    return out


def summary(rows: list[dict], key: str) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    return {
        k: {
            "n": len(v),
            "exact_vs_teacher": round(sum(r["exact"] for r in v) / len(v), 3),
            "token_agreement": round(sum(r["agree"] for r in v) / len(v), 4),
            "teacher_vs_truth": round(sum(r["teacher_truth"] for r in v) / len(v), 3),
        }
        for k, v in sorted(groups.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=20261201, help="this script's own draw")
    ap.add_argument("--scale", type=int, default=1, help="63 prompts each")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(REFERENCE_BASE, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(
        REFERENCE_BASE, local_files_only=True, dtype=torch.float32
    ).eval()
    rows, t0 = [], time.perf_counter()
    with embedded_stack(2, REFERENCE_BASE, REFERENCE_DECODER) as urls:
        client = OpenAI(base_url=f"{urls.http}/v1", api_key="none")
        for p in draw(a.seed, a.scale):
            truth = solve(p)
            budget = len(truth) + 16
            ids = tok(p, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                g = base.generate(ids, max_new_tokens=budget, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
            teacher = tok.decode(g[0, ids.shape[1] :], skip_special_tokens=True)
            got = (
                client.completions.create(
                    model=DEFAULT_MODEL_NAME, prompt=p, max_tokens=budget, temperature=0
                )
                .choices[0]
                .text
            )
            agree = sum(x == y for x, y in zip(got, teacher, strict=False)) / max(1, len(teacher))
            rows.append({"prompt": p, "family": p.split(":")[0], "bucket": bucket_of(max(1, len(teacher))),
                         "exact": got == teacher, "teacher_truth": teacher == truth,
                         "agree": agree, "got": got[:80], "teacher": teacher[:80]})  # fmt: skip
    report = {
        "prompts": len(rows),
        "seed": a.seed,
        "exact_vs_teacher": round(sum(r["exact"] for r in rows) / len(rows), 3),
        "by_bucket": summary(rows, "bucket"),
        "by_family": summary(rows, "family"),
        "misses": [r for r in rows if not r["exact"]],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
