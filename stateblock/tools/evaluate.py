"""The quality report: readout vs the base model's own AR answer, by depth bucket and family.

Held-out prompts only (no prompt of the report was ever trained on). The teacher column is
the base model's greedy AR answer, computed exactly as in distillation. The readout reads the
rows of a masked eager capture, or with `capture_compile` those the compiled capture service
gives: the backbone compiled, SDPA without a mask, right-padded ids and no mask.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from stateblock.model.capture import capture, compile_as_served, lm_head_weight
from stateblock.model.checkpoint import load_decoder
from stateblock.model.loading import load_base
from stateblock.model.vocab import NO_EOS, distinct_n
from stateblock.train import tasks
from stateblock.train.batching import budget_batches
from stateblock.train.reference import encode_examples
from stateblock.train.teacher import greedy_answers

BUCKETS, bucket_of = tasks.BUCKETS, tasks.bucket_of  # one definition, the suite's
METRICS = (
    "exact_match_vs_teacher",
    "token_agreement_vs_teacher",
    "eos_agreement",
    "eos_early",  # the readout stops before the teacher does
    "eos_late",  # after it, or not within the depth read
    "teacher_exact_vs_truth",
    "readout_exact_vs_truth",
    "distinct4_teacher",
    "distinct4_readout",
)


@torch.no_grad()
def read_out(
    base,
    decoder,
    lm_head,
    prompts: list[list[int]],
    depths: list[int],
    pad: int,
    device,
    budget: int = 16384,
    masked: bool = True,
) -> list[tuple[list[int], int]]:
    """(tokens[:depth], eos position) per prompt: one capture + one readout call per batch;
    without `masked` the capture gets no mask, as the service runs it (right padding)."""
    out: list[tuple[list[int], int]] = [([], NO_EOS)] * len(prompts)
    batches = budget_batches(depths, budget, max_batch=128)
    for batch in tqdm(batches, desc="readout", unit="batch", mininterval=5):
        p_w, d = max(len(prompts[i]) for i in batch), max(depths[i] for i in batch)
        ids = torch.full((len(batch), p_w), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):
            ids[r, : len(prompts[i])], mask[r, : len(prompts[i])] = torch.tensor(prompts[i]), 1
        ids, mask = ids.to(device), mask.to(device)
        rows = capture(base, ids, mask if masked else None)
        pos = torch.arange(d, device=device).expand(len(batch), -1)
        dep = torch.tensor([depths[i] for i in batch], device=device)
        res = decoder(rows, mask.sum(-1), pos, dep, lm_head)
        toks, eos = res.tokens.cpu().tolist(), res.eos_pos.cpu().tolist()
        for r, i in enumerate(batch):
            out[i] = (toks[r][: depths[i]], eos[r])
    return out


def answers(teacher: list[int], readout: tuple[list[int], int], eos: int):
    """(teacher answer, its EOS position, readout answer, its EOS position): each cut at its
    EOS (NO_EOS: none, the whole read)."""
    t_eos = len(teacher) - 1 if teacher and teacher[-1] == eos else NO_EOS
    t_ans = teacher[:t_eos] if t_eos != NO_EOS else teacher
    r_toks, r_eos = readout
    r_ans = r_toks[:r_eos] if r_eos != NO_EOS else r_toks
    return t_ans, t_eos, r_ans, r_eos


def score(teacher: list[int], readout: tuple[list[int], int], truth: list[int], eos: int) -> dict:
    t_ans, t_eos, r_ans, r_eos = answers(teacher, readout, eos)
    r_toks = readout[0]
    agree = sum(int(a == b) for a, b in zip(r_toks, teacher, strict=False))
    return {
        "len": len(t_ans),
        "exact": r_ans == t_ans and r_eos == t_eos,
        "agree": agree,
        "positions": len(teacher),
        "eos": r_eos == t_eos,
        "eos_early": r_eos < t_eos,  # NO_EOS is the largest position: never early
        "eos_late": r_eos > t_eos,
        "t_truth": t_ans == truth and t_eos != NO_EOS,
        "r_truth": r_ans == truth and r_eos != NO_EOS,
        "d4_t": distinct_n(t_ans),
        "d4_r": distinct_n(r_ans),
    }


def miss(
    ex: tasks.Example,
    scored: dict,
    teacher: list[int],
    readout: tuple[list[int], int],
    tok,
    eos: int,
    context: int = 12,
) -> dict:
    """One prompt the readout got wrong (`scored` is its `score`), to be read: where its
    answer first leaves the teacher's, how (a wrong token, or a stop before or after the
    teacher's), and who is right."""
    t_ans, _, r_ans, r_eos = answers(teacher, readout, eos)
    both = min(len(r_ans), len(t_ans))
    at = next((i for i in range(both) if r_ans[i] != t_ans[i]), both)
    kind = "token" if at < both else "eos_early" if len(r_ans) < len(t_ans) else "eos_late"
    lo = max(0, at - context)
    said = lambda ids: tok.decode(ids[lo : at + context], skip_special_tokens=True)  # noqa: E731
    return {
        "prompt": ex.prompt if len(ex.prompt) <= 80 else ex.prompt[:77] + "...",
        "family": ex.family,
        "bucket": bucket_of(max(1, scored["len"])),
        "kind": kind,
        "at": at,
        "teacher_len": scored["len"],
        "readout_len": len(r_ans) if r_eos != NO_EOS else None,  # None: no EOS within the read
        "teacher_right": scored["t_truth"],
        "readout_right": scored["r_truth"],
        "teacher": said(t_ans),
        "readout": said(r_ans),
    }


def _summary(rows: list[dict]) -> dict:
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 4) if xs else None

    pos = sum(r["positions"] for r in rows)
    return {
        "n": len(rows),
        "exact_match_vs_teacher": mean([float(r["exact"]) for r in rows]),
        "token_agreement_vs_teacher": round(sum(r["agree"] for r in rows) / pos, 4)
        if pos
        else None,
        "eos_agreement": mean([float(r["eos"]) for r in rows]),
        "eos_early": mean([float(r["eos_early"]) for r in rows]),
        "eos_late": mean([float(r["eos_late"]) for r in rows]),
        "teacher_exact_vs_truth": mean([float(r["t_truth"]) for r in rows]),
        "readout_exact_vs_truth": mean([float(r["r_truth"]) for r in rows]),
        "distinct4_teacher": mean([r["d4_t"] for r in rows]),
        "distinct4_readout": mean([r["d4_r"] for r in rows]),
    }


def evaluate(
    base_dir,
    decoder_dir,
    *,
    n_each: int = 40,
    seed: int = 1234,
    device: str = "cpu",
    families: tuple[str, ...] | None = None,
    max_answer: int | None = None,
    capture_compile: str = "off",
    capture_rope: str = "fused",
) -> dict:
    """The report of one decoder (`evaluate_many` of one)."""
    return evaluate_many(
        base_dir,
        [decoder_dir],
        n_each=n_each,
        seed=seed,
        device=device,
        families=families,
        max_answer=max_answer,
        capture_compile=capture_compile,
        capture_rope=capture_rope,
    )[0]


def evaluate_many(
    base_dir,
    decoder_dirs: list,
    *,
    n_each: int = 40,
    seed: int = 1234,
    device: str = "cpu",
    families: tuple[str, ...] | None = None,
    max_answer: int | None = None,
    capture_compile: str = "off",
    capture_rope: str = "fused",
) -> list[dict]:
    """One report per decoder, all against one teacher pass on the same prompts: comparing
    decoder arms costs one teacher (most of an eval's time on the CPU) and not one each.
    Every decoder is checked against the base before the teacher runs. `capture_compile`
    (a torch.compile backend or mode, or "off"): the readouts read the rows the compiled
    capture service gives (`capture_rope` its STATEBLOCK_CAPTURE_ROPE); the teacher stays
    the eager greedy answer."""
    if not decoder_dirs:
        raise ValueError("evaluate_many needs at least one decoder")
    base, tok = load_base(base_dir, device)
    lm_head = lm_head_weight(base)
    loaded = [
        load_decoder(d, base_dir=base_dir, lm_head=lm_head, device=device) for d in decoder_dirs
    ]
    names = families or tuple(tasks.FAMILIES)
    examples = [
        e for f in names for e in tasks.generate(n_each, split="heldout", seed=seed, families=(f,))
    ]
    pairs = encode_examples(tok, examples)
    # the longest envelope any of them was trained under: a shorter one would cut the teacher
    max_answer = max_answer or max(m["training"]["config"]["max_answer"] for _, m in loaded)
    teacher = greedy_answers(
        base, pairs, eos=tok.eos_token_id, pad=tok.pad_token_id, max_new=max_answer, device=device
    )
    depths = [min(8192, len(t) + 64) for t in teacher]
    served = capture_compile != "off"
    if served:  # after the teacher: its cached decoding stays eager
        compile_as_served(base, capture_compile, rope_table=capture_rope == "table")
    reports = []
    for decoder, manifest in loaded:
        readouts = read_out(
            base, decoder, lm_head, [p for p, _ in pairs], depths, tok.pad_token_id, device,
            masked=not served,
        )  # fmt: skip
        report = _report(examples, pairs, teacher, readouts, tok, names)
        report["settings"] = {
            "n_each": n_each,
            "seed": seed,
            "split": "heldout",
            "decoder_digest": manifest["decoder_digest"],
            "max_answer": max_answer,
            "capture_compile": capture_compile,
            "capture_rope": capture_rope if served else None,
        }
        reports.append(report)
    return reports


def _report(examples, pairs, teacher, readouts, tok, names) -> dict:
    """Scores of one decoder's readouts against the teacher: by bucket, by family, misses."""
    scored = [
        score(t, r, a, tok.eos_token_id)
        for t, r, (_, a) in zip(teacher, readouts, pairs, strict=True)
    ]
    by_bucket, by_family = defaultdict(list), defaultdict(list)
    for ex, s in zip(examples, scored, strict=True):
        by_bucket[bucket_of(max(1, s["len"]))].append(s)
        by_family[ex.family].append(s)
    wrong = [
        miss(ex, s, t, r, tok, tok.eos_token_id)
        for ex, t, r, s in zip(examples, teacher, readouts, scored, strict=True)
        if not s["exact"]
    ]
    return {
        "buckets": {f"{lo}-{hi}": _summary(by_bucket[f"{lo}-{hi}"]) for lo, hi in BUCKETS},
        "families": {f: _summary(by_family[f]) for f in names},
        "misses": wrong,
    }


def comparison(reports: list[dict], labels: list[str]) -> str:
    """A markdown table of several decoders on the same prompts: misses (and those where the
    teacher is right), exact vs the teacher by bucket, the lowest family."""
    buckets = list(reports[0]["buckets"])
    head = (
        "| decoder | misses | teacher right | "
        + " | ".join(buckets)
        + " | lowest family |\n|---|---:|---:|"
        + "---:|" * len(buckets)
        + "---|\n"
    )
    lines = []
    for label, r in zip(labels, reports, strict=True):
        exact = [r["buckets"][b]["exact_match_vs_teacher"] for b in buckets]
        fam, low = min(r["families"].items(), key=lambda kv: kv[1]["exact_match_vs_teacher"])
        lines.append(
            f"| {label} | {len(r['misses'])} | "
            f"{sum(m['teacher_right'] for m in r['misses'])} | "
            + " | ".join("-" if e is None else f"{e:.3f}" for e in exact)
            + f" | {fam} {low['exact_match_vs_teacher']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["buckets"])
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, metric in enumerate(METRICS[:3]):
        vals = [report["buckets"][b][metric] or 0.0 for b in names]
        ax.bar([i + 0.27 * (k - 1) for i in range(len(names))], vals, width=0.27, label=metric)
    ax.set_xticks(range(len(names)), [f"{b}\n(n={report['buckets'][b]['n']})" for b in names])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("teacher answer length (tokens)")
    ax.set_title("readout vs the base model's own greedy AR answer (held-out)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict, command: str) -> str:
    head = "| | n | " + " | ".join(METRICS) + " |\n|---|---|" + "---|" * len(METRICS) + "\n"

    def table(section: str) -> str:
        lines = [
            f"| {k} | {v['n']} | "
            + " | ".join("-" if v[m] is None else f"{v[m]:.4f}" for m in METRICS)
            + " |"
            for k, v in report[section].items()
        ]
        return head + "\n".join(lines) + "\n"

    return (
        f"Command: `{command}`\n\n### By teacher answer length\n\n{table('buckets')}\n"
        f"### By family\n\n{table('families')}\n"
    )


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
