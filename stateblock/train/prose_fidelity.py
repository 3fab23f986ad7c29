"""The prose readout's teacher and its evaluation (issue 41, items 4-5).

Teacher: the base's own greedy answer to each prompt, to its `<eos>` or a cap
(`teacher.greedy_answers`: one verifying forward where the base answers the truth, step by
step from its first deviation), with the truth kept for the determined tasks, so the base's
own accuracy and the distinct-4 of its continuations are reported beside.

Evaluation: the readout's answer (one capture, one readout, cut after its first `<eos>`)
against the teacher's, by task and by the teacher answer's length: exact match, token
agreement (the teacher's positions the readout matches), EOS agreement (the same end, or
neither ends) and, over the answers that differ, the base's negative log-likelihood of the
readout's answer minus that of its own greedy answer, per teacher token.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from stateblock.model.capture import lm_head_weight
from stateblock.model.pointer import capture_pointing
from stateblock.train import prose_tasks
from stateblock.train.batching import budget_batches
from stateblock.train.prose_eval import distinct
from stateblock.train.tasks import bucket_of
from stateblock.train.teacher import greedy_answers


def teacher_records(model, tok, examples: list[prose_tasks.Example], cap: int, device,
                    budget: int = 65536) -> list[dict]:  # fmt: skip
    """Per example: its family, prompt and prompt ids, the base's greedy answer ids (with
    `<eos>` when emitted within `cap`) and, for a determined family, the truth's ids."""
    prompts = tok([e.prompt for e in examples])["input_ids"]
    truths = tok([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    cands = [t if e.determined else [] for e, t in zip(examples, truths, strict=True)]
    answers = greedy_answers(model, list(zip(prompts, cands, strict=True)), eos=tok.eos_token_id,
                             pad=tok.pad_token_id, max_new=cap, device=device, budget=budget)  # fmt: skip
    return [
        {
            "family": e.family,
            "prompt": e.prompt,
            "prompt_ids": p,
            "answer_ids": a,
            "truth_ids": t if e.determined else None,
        }  # fmt: skip
        for e, p, a, t in zip(examples, prompts, answers, truths, strict=True)
    ]


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None


def base_report(records: list[dict], eos: int) -> dict:
    """The teacher against the truth: exact by determined family (greedy answer == truth +
    `<eos>`), and its continuations' distinct-4, length and share that ended."""
    by: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        if r["truth_ids"] is not None:
            by[r["family"]].append(r["answer_ids"] == [*r["truth_ids"], eos])
    cont = [r["answer_ids"] for r in records if r["truth_ids"] is None]
    text = [a[:-1] if a and a[-1] == eos else a for a in cont]
    return {
        "exact_vs_truth": {f: _mean(v) for f, v in sorted(by.items())},
        "exact_vs_truth_all": _mean(x for v in by.values() for x in v),
        "continuations": {
            "n": len(cont),
            "distinct4": distinct(text),
            "ended_with_eos": _mean(bool(a) and a[-1] == eos for a in cont),
            "mean_tokens": _mean(len(a) for a in cont),
        },  # fmt: skip
    }


def _padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


@torch.no_grad()
def readout_answers(base, decoder, records: list[dict], cap: int, pad: int, device,
                    budget: int = 65536) -> list[list[int]]:  # fmt: skip
    """Each prompt's readout at depth `cap`: every position's token (as served, argmax)."""
    lm_head = lm_head_weight(base)
    out: list[list[int]] = [[] for _ in records]
    lengths = [len(r["prompt_ids"]) + cap for r in records]
    for batch in budget_batches(lengths, budget, max_batch=256):
        ids, lens = _padded([records[i]["prompt_ids"] for i in batch], pad)
        ids, lens = ids.to(device), lens.to(device)
        # right-padded: causal rows need no mask
        rows, point = capture_pointing(base, ids, lens, maps=bool(decoder.cfg.copy_point))
        pos = torch.arange(cap, device=device).expand(len(batch), -1)
        depth = torch.full((len(batch),), cap, device=device)
        out_ = decoder(rows, lens, pos, depth, lm_head, prompt_ids=ids, point=point)
        got = out_.tokens.cpu().tolist()
        for i, tokens in zip(batch, got, strict=True):
            out[i] = tokens
    return out


def cut(tokens: list[int], eos: int) -> list[int]:
    """An answer as served: the tokens up to and including the first `<eos>`."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@torch.no_grad()
def answer_nll(base, prompts: list[list[int]], answers: list[list[int]], pad: int, device,
               budget: int = 65536) -> list[float]:  # fmt: skip
    """The base's summed negative log-likelihood of each answer after its prompt."""
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    out = [0.0] * len(seqs)
    for batch in budget_batches([len(s) for s in seqs], budget, max_batch=256):
        ids, _ = _padded([seqs[i] for i in batch], pad)
        lab = torch.full_like(ids, -100)
        for r, i in enumerate(batch):
            p, n = len(prompts[i]), len(answers[i])
            lab[r, p - 1 : p + n - 1] = torch.tensor(answers[i])
        logits = base(input_ids=ids.to(device)).logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), lab.to(device).flatten(), ignore_index=-100,
                             reduction="none").view(lab.shape)  # fmt: skip
        for r, i in enumerate(batch):
            out[i] = float(ce[r].sum())
    return out


def compare(teacher: list[int], tokens: list[int], eos: int) -> dict:
    """One answer's figures: exact, token agreement over the teacher's positions, EOS
    agreement (the first `<eos>` at the same position, or none in either), and where they
    disagree which way: `ends` "early" (the readout stops first) or "late" (after the
    teacher's `<eos>`, or not at all), None where they agree."""
    served = cut(tokens, eos)
    agree = sum(a == b for a, b in zip(teacher, tokens, strict=False)) / max(1, len(teacher))
    t_end = teacher.index(eos) if eos in teacher else None
    r_end = served.index(eos) if eos in served else None
    ends = None
    if t_end != r_end:
        early = r_end is not None and (t_end is None or r_end < t_end)
        ends = "early" if early else "late"
    return {"exact": served == teacher, "tokens": agree, "eos": t_end == r_end, "ends": ends}


def fidelity(base, decoder, records: list[dict], cap: int, eos: int, pad: int, device) -> dict:
    """Readout vs teacher on `records` by family and by teacher length bucket."""
    tokens = readout_answers(base, decoder, records, cap, pad, device)
    return figures(base, records, tokens, eos, pad, device) | {
        "readouts": [cut(t, eos) for t in tokens]
    }


def figures(base, records: list[dict], tokens: list[list[int]], eos: int, pad: int,
            device) -> dict:  # fmt: skip
    """`tokens` (each prompt's answer, read or served) against the teacher's answer_ids, by
    family and by teacher length bucket, with the base's NLL gap where they differ."""
    rows = [compare(r["answer_ids"], t, eos) for r, t in zip(records, tokens, strict=True)]
    differ = [i for i, x in enumerate(rows) if not x["exact"]]
    prompts = [records[i]["prompt_ids"] for i in differ]
    mine = answer_nll(base, prompts, [cut(tokens[i], eos) for i in differ], pad, device)
    theirs = answer_nll(base, prompts, [records[i]["answer_ids"] for i in differ], pad, device)
    for i, m, t in zip(differ, mine, theirs, strict=True):
        rows[i]["nll_gap"] = (m - t) / max(1, len(records[i]["answer_ids"]))
    groups: dict[str, dict[str, list[dict]]] = {"family": defaultdict(list),
                                                "bucket": defaultdict(list)}  # fmt: skip
    for r, x in zip(records, rows, strict=True):
        groups["family"][r["family"]].append(x)
        groups["bucket"][bucket_of(len(r["answer_ids"]))].append(x)
        groups["family"]["all"].append(x)
    return {by: {k: _figures(v) for k, v in sorted(g.items())} for by, g in groups.items()}


def _figures(rows: list[dict]) -> dict:
    gaps = [x["nll_gap"] for x in rows if "nll_gap" in x]
    return {"n": len(rows), "exact": _mean(x["exact"] for x in rows),
            "token_agreement": _mean(x["tokens"] for x in rows),
            "eos_agreement": _mean(x["eos"] for x in rows),
            "ends_early": _mean(x["ends"] == "early" for x in rows),
            "ends_late": _mean(x["ends"] == "late" for x in rows),
            "differ": len(gaps), "nll_gap_per_token": _mean(gaps)}  # fmt: skip


def _row(cells) -> str:
    return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"


def markdown(summary: dict) -> str:
    """The build's figures as markdown: the base against the truth, then the readout."""
    base = summary["base"]
    c = base["continuations"]
    lines = ["# Prose readout", "",
             f"Base vs truth (greedy, exact): {base['exact_vs_truth_all']} over the determined "
             f"tasks; continuations: distinct-4 {c['distinct4']}, {c['mean_tokens']} tokens on "
             f"average, {c['ended_with_eos']} ended with `<eos>` (n {c['n']}).", "",
             _row(["task", "base exact vs truth"]), "|---|---:|"]  # fmt: skip
    lines += [_row([f, v]) for f, v in base["exact_vs_truth"].items()]
    for by in ("family", "bucket"):
        lines += ["", _row([by, "n", "exact", "token agreement", "EOS agreement",
                            "ends early / late", "differ", "NLL gap / token"]),
                  "|---|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
        for k, f in summary["readout"][by].items():
            ends = f"{f.get('ends_early', '-')} / {f.get('ends_late', '-')}"
            lines.append(_row([k, f["n"], f["exact"], f["token_agreement"], f["eos_agreement"],
                               ends, f["differ"], f["nll_gap_per_token"]]))  # fmt: skip
    return "\n".join(lines) + "\n"
