"""Parity audit and release gate: one readout engine against `reference`, depth by depth.

Held-out prompts are captured once with the base model; at every depth both engines read
the same captured rows (K lanes per enqueue) and every lane is compared. A mismatch is a
near-tie when the reference's top-1 minus top-2 margin is below 0.05 at every position
where the two answers differ: there the reference itself barely preferred its token, so
another engine's rounding may legitimately pick the runner-up. Anything else is a
divergence, and the gate fails on it.

EOS-boundary rule: the lanes' EOS positions must be equal (both the same position, or both
the no-EOS sentinel, reported as `agree_absent`, never as a matched EOS). When they differ,
the disagreement sits at the earlier of the two EOS positions, where one side emitted EOS
and the other a token; it is excused (`near_tie`) only if the reference margin there is
below 0.05, and is a gate failure (`mismatch`) otherwise.

Log-probabilities: the engine reads every depth twice, as served: plain greedy lanes (the
token and EOS gates above), then lanes that ask for log-probabilities (logprobs=2), which an
engine may run at another precision (the torch engine's exact-dot graphs). On that second
read, at each position where both engines return the same top-1 id, the top-1
log-probability and the emitted token's (where the tokens agree too) must be within
LOGPROB_TOL (1e-3 nats) of the reference's; the worst error is reported per depth, and that
read's tokens must pass the same divergence gate.

The decoder is not autoregressive (position t never sees token t-1), so a near-tie at one
position does not explain a difference at a later one: every differing position is
classified, not just the first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from stateblock.engines import LaneRequest, LaneResult, ReadoutEngine
from stateblock.model.capture import capture
from stateblock.model.loading import ServingModel
from stateblock.model.vocab import NO_EOS, distinct_n
from stateblock.protocol.sampling import K_MAX, sampling_params  # lanes per enqueue, as served
from stateblock.train import tasks

NEAR_TIE = 0.05  # reference top-1 minus top-2 logit below this is a near-tie
LOGPROB_TOL = 1e-3  # nats: exact log-probabilities, up to the engines' rounding
DEFAULT_DEPTHS = (256, 512, 1024, 2048, 4096, 8192)
PLAIN = sampling_params()  # greedy
AUDITED = sampling_params(logprobs=2)  # greedy, with both candidates' log-probabilities
CAPTURE_BATCH = 32
LONG_WEIGHT = 4.0


@dataclass(frozen=True)
class LaneComparison:
    mismatch: dict | None  # None when both answers are identical
    eos: str  # "agree" | "agree_absent" | "near_tie" | "mismatch"


def emitted(r: LaneResult, eos_token_id: int) -> tuple[int, ...]:
    """What the lane emitted, position by position: its tokens, then EOS if it had one."""
    return r.token_ids + ((eos_token_id,) if r.eos_pos != NO_EOS else ())


def _margin(ref: LaneResult, t: int) -> float | None:
    # The reference reports margins up to and including its EOS; every position compared
    # below lies in that range for a well-formed result. None (unknown) never excuses.
    return ref.margins[t] if t < len(ref.margins) else None


def _near(m: float | None, near_tie: float) -> bool:
    return m is not None and m < near_tie


def compare_lane(
    prompt: int,
    ref: LaneResult,
    eng: LaneResult,
    *,
    eos_token_id: int,
    near_tie: float = NEAR_TIE,
) -> LaneComparison:
    """Compare one lane's answers; pure, so the rules are tested on hand-built results."""
    a, b = emitted(ref, eos_token_id), emitted(eng, eos_token_id)
    if ref.eos_pos == eng.eos_pos:
        eos = "agree_absent" if ref.eos_pos == NO_EOS else "agree"
    else:
        at = min(ref.eos_pos, eng.eos_pos)  # one side emitted EOS here, the other did not
        eos = "near_tie" if _near(_margin(ref, at), near_tie) else "mismatch"
    common = min(len(a), len(b))
    differ = [t for t in range(common) if a[t] != b[t]]
    n_differ = len(differ) + max(len(a), len(b)) - common
    if n_differ == 0:
        return LaneComparison(None, eos)
    # Past the common length one side has stopped: that is decided at an earlier, compared
    # position, unless the result is malformed (tokens past its own EOS), then at `common`.
    judged = differ or [common]
    first = judged[0]
    margins = {t: _margin(ref, t) for t in judged}
    worst = max(judged, key=lambda t: float("inf") if margins[t] is None else margins[t])
    near = all(_near(m, near_tie) for m in margins.values())
    mismatch = {
        "prompt": prompt,
        "position": first,
        "n_differ": n_differ,
        "ref_token": a[first] if first < len(a) else None,
        "engine_token": b[first] if first < len(b) else None,
        "ref_margin": margins[first],
        "worst_position": worst,
        "worst_ref_margin": margins[worst],
        "class": "near_tie" if near else "divergence",
    }
    return LaneComparison(mismatch, eos)


def logprob_error(ref: Sequence[LaneResult], eng: Sequence[LaneResult]) -> float | None:
    """Worst |engine - reference| log-probability over positions whose ids agree."""
    worst = None
    for r, e in zip(ref, eng, strict=True):
        if r.logprobs is None or e.logprobs is None:
            continue
        a, b = r.logprobs, e.logprobs
        for t in range(min(len(a.top1), len(b.top1))):
            if a.top1_ids[t] != b.top1_ids[t]:
                continue
            err = abs(a.top1[t] - b.top1[t])
            if t < min(len(r.token_ids), len(e.token_ids)) and r.token_ids[t] == e.token_ids[t]:
                err = max(err, abs(a.token[t] - b.token[t]))
            worst = err if worst is None else max(worst, err)
    return worst


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def depth_report(
    ref: Sequence[LaneResult],
    eng: Sequence[LaneResult],
    *,
    eos_token_id: int,
    near_tie: float = NEAR_TIE,
) -> dict:
    """One depth's section of the report, from both engines' results for the same lanes."""
    cmp = [
        compare_lane(i, r, e, eos_token_id=eos_token_id, near_tie=near_tie)
        for i, (r, e) in enumerate(zip(ref, eng, strict=True))
    ]
    mismatches = [c.mismatch for c in cmp if c.mismatch is not None]
    lanes_eos = [c.eos for c in cmp]
    d4_ref = _mean([distinct_n(list(r.token_ids)) for r in ref])
    d4_eng = _mean([distinct_n(list(e.token_ids)) for e in eng])
    if "mismatch" in lanes_eos:
        parity = "mismatch"
    elif "near_tie" in lanes_eos:
        parity = "agree_except_near_ties"
    elif all(s == "agree_absent" for s in lanes_eos):
        parity = "agree_absent"
    else:
        parity = "agree"
    return {
        "lanes": len(cmp),
        "exact_match": round(sum(c.mismatch is None for c in cmp) / len(cmp), 4),
        "mismatches": mismatches,
        "near_tie": sum(m["class"] == "near_tie" for m in mismatches),
        "non_near_tie": sum(m["class"] == "divergence" for m in mismatches),
        "eos_ref": [r.eos_pos for r in ref],
        "eos_engine": [e.eos_pos for e in eng],
        "eos_parity": parity,
        "eos_lanes": lanes_eos,
        "eos_agree": lanes_eos.count("agree"),
        "eos_absent_both": lanes_eos.count("agree_absent"),
        "eos_near_tie": lanes_eos.count("near_tie"),
        "eos_mismatch": lanes_eos.count("mismatch"),
        "distinct4_ref": d4_ref,
        "distinct4_engine": d4_eng,
        "distinct4_delta": None if d4_ref is None or d4_eng is None else round(d4_eng - d4_ref, 4),
        "logprob_max_abs_error": logprob_error(ref, eng),
    }


def _fmt(margin: float | None) -> str:
    return "unknown" if margin is None else f"{margin:.4f}"


def blockers(depths: dict[str, dict]) -> list[str]:
    """Every failing gate, one line per depth and kind; nothing folded together."""
    out = []
    for depth, d in depths.items():
        if "error" in d:
            out.append(f"depth {depth}: error: the engine failed: {d['error']}")
            continue
        divergent = [m for m in d["mismatches"] if m["class"] == "divergence"]
        if divergent:
            where = ", ".join(
                f"prompt {m['prompt']} pos {m['worst_position']} (margin {_fmt(m['worst_ref_margin'])})"
                for m in divergent
            )
            out.append(
                f"depth {depth}: divergence: {len(divergent)} lane(s) differ where the reference "
                f"margin is >= {NEAR_TIE}: {where}"
            )
        lp_read = d.get("logprob_read") or {}
        if lp_read.get("non_near_tie") or lp_read.get("eos_mismatch"):
            out.append(
                f"depth {depth}: logprob read: {lp_read.get('non_near_tie', 0)} divergent lane(s) "
                f"and {lp_read.get('eos_mismatch', 0)} EOS mismatch(es) on the lanes that asked "
                "for log-probabilities"
            )
        err = d.get("logprob_max_abs_error")
        if err is not None and err > LOGPROB_TOL:
            out.append(
                f"depth {depth}: logprobs: an exact log-probability is {err:.2e} nats from the "
                f"reference's (gate {LOGPROB_TOL:g})"
            )
        if d["eos_mismatch"]:
            lanes = [i for i, s in enumerate(d["eos_lanes"]) if s == "mismatch"]
            where = ", ".join(
                f"prompt {i} (reference {d['eos_ref'][i]}, engine {d['eos_engine'][i]})"
                for i in lanes
            )
            out.append(
                f"depth {depth}: eos_parity: {len(lanes)} lane(s) end at a different EOS "
                f"position, not at a near-tie: {where}"
            )
    return out


def heldout_rows(model: ServingModel, n_prompts: int, seed: int) -> list[Tensor]:
    """Held-out prompts, captured once with the base model: one (P_i, d_base) per prompt."""
    # The audit reads up to 8192 positions, but most answers of the short families end
    # within a few dozen: weighting the long families up puts answers at every depth.
    weights = {f: LONG_WEIGHT for f in tasks.LONG_FAMILIES}
    examples = tasks.generate(n_prompts, split="heldout", seed=seed, weights=weights)
    tok = model.tokenizer
    ids = tok([e.prompt for e in examples])["input_ids"]
    device = model.lm_head.device
    out: list[Tensor] = []
    for lo in range(0, len(ids), CAPTURE_BATCH):
        batch = ids[lo : lo + CAPTURE_BATCH]
        width = max(len(x) for x in batch)
        x = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, seq in enumerate(batch):
            x[r, : len(seq)], mask[r, : len(seq)] = torch.tensor(seq), 1
        rows = capture(model.model, x.to(device), mask.to(device))  # (B, P, d_base)
        out += [rows[r, : len(seq)].clone() for r, seq in enumerate(batch)]
    return out


def read_all(
    engine: ReadoutEngine, rows: list[Tensor], depth: int, lanes: int, sampling=AUDITED
) -> list[LaneResult]:
    """Every prompt at one depth, `lanes` per packed enqueue."""
    out: list[LaneResult] = []
    for lo in range(0, len(rows), lanes):
        out += engine.readout(
            [LaneRequest(rows=r, depth=depth, sampling=sampling) for r in rows[lo : lo + lanes]]
        )
    return out


def parity_audit(
    model: ServingModel,
    engine: ReadoutEngine,
    reference: ReadoutEngine,
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    n_prompts: int = 32,
    seed: int = 4321,
    lanes: int = K_MAX,
    near_tie: float = NEAR_TIE,
) -> dict:
    """The JSON report: per-depth comparison, gate and blockers. Engines are passed in, so
    a test can audit an engine that exists only in the test."""
    if n_prompts < 1 or lanes < 1 or not depths:
        raise ValueError("the audit needs at least one prompt, one lane and one depth")
    if engine.identity != reference.identity:
        raise ValueError("the engine and the reference serve different model pieces")
    eos = int(model.manifest["decoder_config"]["eos_token_id"])
    t0 = time.perf_counter()
    rows = heldout_rows(model, n_prompts, seed)
    report_depths: dict[str, dict] = {}
    for depth in depths:
        t1 = time.perf_counter()
        ref = read_all(reference, rows, depth, lanes)
        t2 = time.perf_counter()
        try:
            got = read_all(engine, rows, depth, lanes, PLAIN)
            t3 = time.perf_counter()
            got_lp = read_all(engine, rows, depth, lanes, AUDITED)
        except Exception as e:  # an engine that cannot read a depth fails that gate, loudly
            report_depths[str(depth)] = {"lanes": len(rows), "error": repr(e)}
            continue
        section = depth_report(ref, got, eos_token_id=eos, near_tie=near_tie)
        lp = depth_report(ref, got_lp, eos_token_id=eos, near_tie=near_tie)
        section["logprob_max_abs_error"] = lp["logprob_max_abs_error"]
        section["logprob_read"] = {
            k: lp[k] for k in ("exact_match", "near_tie", "non_near_tie", "eos_mismatch")
        } | {"divergences": [m for m in lp["mismatches"] if m["class"] == "divergence"]}
        section["seconds_reference"] = round(t2 - t1, 3)
        section["seconds_engine"] = round(t3 - t2, 3)
        section["seconds_engine_logprobs"] = round(time.perf_counter() - t3, 3)
        report_depths[str(depth)] = section
    found = blockers(report_depths)
    return {
        "engine": engine.name,
        "reference": reference.name,
        "gate": "FAIL" if found else "PASS",
        "blockers": found,
        "depths": report_depths,
        "settings": {
            "n_prompts": n_prompts,
            "split": "heldout",
            "seed": seed,
            "depths": list(depths),
            "lanes_per_enqueue": lanes,
            "near_tie": near_tie,
            "eos_token_id": eos,
            "no_eos_sentinel": NO_EOS,
            "model": model.name,
            "decoder_digest": model.manifest["decoder_digest"],
            "device": str(model.lm_head.device),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    depths = [d for d, s in report["depths"].items() if "error" not in s]
    secs = [report["depths"][d] for d in depths]
    x = range(len(depths))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [s["exact_match"] for s in secs], marker="o")
    left.set_ylim(0, 1.05)
    left.set_ylabel("exact-match fraction (lanes)")
    left.set_title(f"{report['engine']} vs {report['reference']}: exact match")
    kinds = (
        ("near_tie", "near-tie"),
        ("non_near_tie", "divergence"),
        ("eos_mismatch", "EOS mismatch"),
    )
    for k, (field, label) in enumerate(kinds):
        right.bar([i + 0.27 * (k - 1) for i in x], [s[field] for s in secs], 0.27, label=label)
    right.set_ylabel("lanes")
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_title(f"mismatches by class (gate {report['gate']})")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(list(x), depths)
        ax.set_xlabel("depth (positions read)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict, command: str) -> str:
    head = (
        "| depth | lanes | exact match | near-tie | divergence | EOS parity | EOS absent both "
        "| distinct-4 ref | distinct-4 engine | logprob max abs error |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def fmt(v, spec: str = ".4f") -> str:
        return "-" if v is None else f"{v:{spec}}" if isinstance(v, float) else str(v)

    rows = []
    for depth, s in report["depths"].items():
        if "error" in s:
            rows.append(f"| {depth} | {s['lanes']} | error | | | | | | | |")
            continue
        cells = ("lanes", "exact_match", "near_tie", "non_near_tie", "eos_parity")
        cells += ("eos_absent_both", "distinct4_ref", "distinct4_engine")
        lp = fmt(s.get("logprob_max_abs_error"), ".1e")
        rows.append(f"| {depth} | " + " | ".join(fmt(s[c]) for c in cells) + f" | {lp} |")
    found = "\n".join(f"- {b}" for b in report["blockers"]) or "- none"
    return (
        f"Command: `{command}`\n\n**Gate: {report['gate']}** ({report['engine']} vs "
        f"{report['reference']})\n\n{head}" + "\n".join(rows) + f"\n\nBlockers:\n\n{found}\n"
    )


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
