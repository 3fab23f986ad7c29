"""The prose pair through the served API on passages outside its corpus
(`python -m bench.prose_api --pair DIR --texts FILE`), issue 41's served check.

The prompts are `prose_tasks`' five tasks drawn over FILE's documents (by default the texts
`python -m stateblock.train.corpus build --foreign` writes: Debian's history and the Bash
manual, which the corpus never read). The teacher is the pair's base's own greedy answer,
computed here as the build's teacher is (`prose_fidelity.teacher_records`). The embedded stack
(`stateblock up` in this process, the pair served) answers each prompt at temperature 0
through the official `openai` client, `max_tokens` the cap. The API returns text, so both
answers are compared as text tokenized again (`<eos>` appended where each stopped): a
readout's tokens and the teacher's that spell the same text count as the same. Reported as
the build's evaluation reports them: exact, token agreement, EOS agreement and, over the
answers that differ, the base's NLL gap per token, by task and by the teacher answer's
length; and each prompt's served text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from openai import OpenAI

from bench.latency_cpu import embedded_stack
from stateblock.model.loading import load_base
from stateblock.train import prose_fidelity, prose_tasks
from stateblock.train.corpus import read_documents


def as_tokens(tok, text: str, stopped: bool) -> list[int]:
    """An answer's text tokenized again, `<eos>` after it where it stopped."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [*ids, tok.eos_token_id] if stopped else ids


def teacher_text(tok, ids: list[int]) -> tuple[str, bool]:
    """The teacher's answer as the API would serve it: its text, and whether it stopped."""
    stopped = tok.eos_token_id in ids
    return tok.decode(prose_fidelity.cut(ids, tok.eos_token_id), skip_special_tokens=True), stopped


def ask(client: OpenAI, model: str, records: list[dict], cap: int) -> list[tuple[str, str]]:
    out = []
    for r in records:
        choice = client.completions.create(
            model=model, prompt=r["prompt"], max_tokens=cap, temperature=0
        ).choices[0]
        out.append((choice.text, choice.finish_reason))
    return out


def run(pair: Path, texts: Path, n: int, seed: int, cap: int, device: str = "cpu",
        base_dir: Path | None = None, decoder_dir: Path | None = None) -> dict:  # fmt: skip
    """Draw, teach, serve and compare; the report (with the base against the truth). The
    pair is pair/base and pair/decoder, or base_dir and decoder_dir."""
    t0 = time.perf_counter()
    base_dir, decoder_dir = base_dir or pair / "base", decoder_dir or pair / "decoder"
    base, tok = load_base(base_dir, device)
    examples = prose_tasks.generate(read_documents(texts), n, seed=seed)
    records = prose_fidelity.teacher_records(base, tok, examples, cap, device)
    teacher = [teacher_text(tok, r["answer_ids"]) for r in records]
    for r, (text, stopped) in zip(records, teacher, strict=True):  # as the API would serve it
        r["answer_ids"] = as_tokens(tok, text, stopped)
    with embedded_stack(2, base_dir, decoder_dir) as urls:
        client = OpenAI(base_url=f"{urls.http}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answers = ask(client, model, records, cap)
    served = [as_tokens(tok, text, reason == "stop") for text, reason in answers]
    return {
        "prompts": len(records),
        "texts": str(texts),
        "seed": seed,
        "max_tokens": cap,
        "base": prose_fidelity.base_report(records, tok.eos_token_id),
        "served": prose_fidelity.figures(
            base, records, served, tok.eos_token_id, tok.pad_token_id, device
        ),
        "answers": [
            {
                "family": r["family"],
                "prompt": r["prompt"],
                "text": text,
                "finish_reason": why,
                "teacher": t_text,
                "teacher_stopped": t_stopped,
            }
            for r, (text, why), (t_text, t_stopped) in zip(records, answers, teacher, strict=True)
        ],  # fmt: skip
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=Path("."), help="DIR/base and DIR/decoder")
    ap.add_argument("--base", type=Path, help="the base (e.g. a build's tuned/), not DIR/base")
    ap.add_argument("--decoder", type=Path, help="the decoder, not DIR/decoder")
    ap.add_argument("--texts", type=Path, default=Path("data/prose-foreign/heldout.txt"),
                    help="documents outside the corpus (corpus build --foreign)")  # fmt: skip
    ap.add_argument("--n", type=int, default=200, help="prompts")
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--max-tokens", type=int, default=256, help="the pair's served depth")
    ap.add_argument("--device", default="cpu", help="where the teacher runs")
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args()
    result = run(a.pair, a.texts, a.n, a.seed, a.max_tokens, a.device, a.base, a.decoder)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
