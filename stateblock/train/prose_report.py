"""A prose stage's summary (`prose_stage.py`'s summary.json) as markdown: the run, one row an
arm, each arm's held-out curve, and three greedy continuations."""

from __future__ import annotations


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _arms(summary: dict) -> list[str]:
    lines = [
        "| arm | passes planned | done | steps | tokens/s | s | best held-out nll | ppl "
        "| bits/byte | bits/word | at pass |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, arm in enumerate(summary["arms"]):
        b = arm["best"]
        lines.append(_row([k, arm["epochs_planned"], arm["epochs_done"], arm["steps"],
                           f"{arm['tokens_per_s']:,}", arm["seconds"], b["nll"], b["perplexity"],
                           b["bits_per_byte"], b["bits_per_word"], b["epoch"]]))  # fmt: skip
    return lines


def _curves(summary: dict) -> list[str]:
    lines = []
    for k, arm in enumerate(summary["arms"]):
        points = ", ".join(f"{c['epoch']}: {c['train_nll']} / {c['heldout_nll']}"
                           for c in arm["curve"])  # fmt: skip
        lines.append(f"- arm {k} (pass: train / held-out nll): {points}")
    return lines


def _continuations(c: dict) -> list[str]:
    if not c or not c.get("n"):
        return []
    lines = [
        "",
        f"Greedy continuations of {c['n']} held-out passages ({c['prompt_tokens']} tokens, "
        f"then {c['new_tokens']}): distinct-4 {c['distinct4']} (the text's own next tokens: "
        f"{c['distinct4_text']}), {c['ended_with_eos']} ended with `<eos>`.",
        "",
    ]
    for s in c["shown"]:
        prompt = s["prompt"].replace("\n", " ⏎ ")
        base = s["base"].replace("\n", " ⏎ ")
        lines.append(f"- *{prompt}* → {base}")
    return lines


def markdown(summary: dict) -> str:
    m, d, st = summary["model"], summary["data"]["splits"], summary["step"]
    ckpt = summary.get("checkpoint", {})
    speed = f"eager {st['eager_ms']} ms a step"
    if "compiled_ms" in st:
        speed += (
            f", compiled {st['compiled_ms']} ms (compile {st['compile_s']} s), used {st['used']}"
        )
    if "error" in st:
        speed += f"; compile failed: {st['error']}"
    lines = [
        "# Prose base stage",
        "",
        f"{summary['machine']['device']}, torch {summary['machine']['torch']}: "
        f"{m['params']:,} parameters (dim {m['dim']}, {m['n_layers']} layers, MLP {m['mlp_dim']}, "
        f"vocabulary {m['vocab_size']:,}); train {d['train']['tokens']:,} tokens, held-out "
        f"{d['heldout']['tokens']:,} tokens ({d['heldout']['bytes']:,} bytes, "
        f"{d['heldout']['words']:,} words). Step: {speed}; {st['tokens_per_s']:,} tokens/s, "
        f"{st['model_tflops']} model TFLOP/s at {st['flops_per_token'] / 1e6:.0f} MFLOP a token.",
        "",
        f"Held-out before training: nll {summary['start']['nll']} "
        f"(ppl {summary['start']['perplexity']}).",
        "",
        *_arms(summary),
        "",
        *_curves(summary),
    ]
    if "best" in summary:
        b = summary["best"]
        lines += ["", f"Best: arm {b['arm']} at pass {b['epoch']}: held-out nll {b['nll']}, "
                      f"perplexity {b['perplexity']}, {b['bits_per_byte']} bits/byte, "
                      f"{b['bits_per_word']} bits/word."]  # fmt: skip
    if ckpt:
        saved = (
            f"saved in {ckpt['parts']} part(s)" if ckpt["saved"] else f"not saved ({ckpt['why']})"
        )
        lines += ["", f"Weights (bf16, {ckpt['mb']} MB): {saved}."]
    lines += _continuations(summary.get("continuations", {}))
    lines.append(f"\nWall: {summary.get('seconds')} s.")
    return "\n".join(lines) + "\n"
