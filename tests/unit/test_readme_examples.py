"""The README's example prompts: each table answer is the truth (an independent solver
here), and the shipped pair gives it (capture + readout in this process, as served)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stateblock.engines import LaneRequest, create_engine
from stateblock.model.loading import load_serving_model

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([a-z]+: [^`]*)` \| `([^`]*)`[^|]*\|", re.M)


def solve(prompt: str) -> str:
    task, arg = prompt.split(": ", 1)
    if task == "copy":
        return arg
    if task == "reverse":
        return arg[::-1]
    if task == "sort":
        return "".join(sorted(arg))
    if task == "add":
        a, b = arg.split("+")
        return f"{int(a) + int(b):06d}"[::-1]
    if task == "recall":
        pairs, key = arg.split(" ?")
        return dict(p.split("=") for p in pairs.split(";"))[key]
    if task == "repeat":
        pat, n = arg.split()
        return " ".join(f"{pat}{i:03d}" for i in range(1, int(n) + 1))
    if task == "alpha":
        num = lambda w: sum(26 ** (2 - i) * (ord(c) - 97) for i, c in enumerate(w))  # noqa: E731
        word = lambda i: "".join(chr(97 + i // 26 ** (2 - k) % 26) for k in range(3))  # noqa: E731
        a, b = arg.split()
        return " ".join(word(i) for i in range(num(a), num(b) + 1))
    if task in ("count", "countdown"):
        a, b = (int(x) for x in arg.split())
        step = 1 if task == "count" else -1
        return " ".join(f"{i:03d}" for i in range(a, b + step, step))
    raise ValueError(task)


EXAMPLES = ROW.findall((ROOT / "README.md").read_text())


def test_the_readme_lists_examples_of_most_families():
    assert len({p.split(":")[0] for p, _ in EXAMPLES}) >= 8


@pytest.mark.parametrize("prompt,answer", EXAMPLES, ids=[p for p, _ in EXAMPLES])
def test_readme_example_is_true_and_answered(prompt, answer, shipped):
    model, engine = shipped
    assert solve(prompt) == answer
    (out,) = engine.readout([LaneRequest(rows=model.prompt_rows(prompt), depth=256)])
    assert model.tokenizer.decode(list(out.token_ids)) == answer


@pytest.fixture(scope="module")
def shipped():
    ref = ROOT / "models" / "reference"
    model = load_serving_model("stateblock-reference", ref / "base", ref / "decoder")
    return model, create_engine("reference", model)
