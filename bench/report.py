"""The e2e bench's report: JSON rewritten after every measurement, a markdown summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.latency_cpu import pct


def ms_summary(seconds: list[float]) -> dict:
    ms = [1000.0 * s for s in seconds]
    return {
        "p50_ms": pct(ms, 50),
        "p90_ms": pct(ms, 90),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


class Report:
    """The JSON document, rewritten after every measurement."""

    def __init__(self, path: Path, doc: dict) -> None:
        self.path, self.doc = path, doc
        self.write()

    def set(self, key: str, value) -> None:
        self.doc[key] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def ratios(doc: dict) -> dict:
    e2e = doc.get("e2e", {}).get("latency", {}).get("p50_ms")
    out = {}
    for mode, ar in doc.get("ar", {}).items():
        if e2e and "answer_s" in ar:
            out[f"ar_{mode}_answer_over_e2e_p50"] = 1000.0 * ar["answer_s"] / e2e
    return out


def markdown(doc: dict) -> str:
    lines = [f"### e2e readout vs AR ({doc['config']['scale']}, {doc['config']['device_name']})"]
    e = doc.get("e2e", {})
    if "latency" in e:
        c = doc["config"]
        lines += [
            f"prompt {c['prompt_len']} tokens, answer {c['max_tokens']} tokens "
            f"(all full depth: {e['all_full_depth']}), engine `{c['engine']}`, n={e['n_ok']}",
            "",
            "| span | p50 (ms) | p90 (ms) | mean (ms) |",
            "|---|---:|---:|---:|",
        ]
        for name, s in [("end-to-end (client)", e["latency"]), *e["breakdown"].items()]:
            lines.append(f"| {name} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | {s['mean_ms']:.2f} |")
    lines += ["", "| AR decode | answer (s) | per token (ms) | note |", "|---|---:|---:|---|"]
    for mode, ar in doc.get("ar", {}).items():
        if "answer_s" in ar:
            lines.append(f"| {mode} | {ar['answer_s']:.3f} | {ar['per_token_ms']:.2f} | "
                         f"{ar['repeats']} repeat(s), {ar['tokens']} tokens |")  # fmt: skip
        else:
            reason = ar.get("skipped") or ar.get("failed", "")
            lines.append(f"| {mode} | - | - | {reason.splitlines()[0] if reason else ''} |")
    for k, v in doc.get("ratios", {}).items():
        lines.append(f"\n{k}: **{v:.1f}x**")
    for name, p in doc.get("prefill", {}).items():
        if "median_ms" in p:
            lines.append(f"\ncapture-only prefill, {name} ({p['params'] / 1e9:.2f} B params, "
                         f"{p['prompt_len']} tokens padded to {p['padded_width']}): "
                         f"{p['median_ms']:.1f} ms")  # fmt: skip
        else:
            why = p.get("skipped") or p.get("failed")
            lines.append(f"\ncapture-only prefill, {name}: not measured ({why})")
    lines.append(f"\nsetup: {json.dumps(doc.get('setup', {}))}")
    lines.append(f"total: {doc.get('elapsed_s', 0):.0f} s")
    return "\n".join(lines)
