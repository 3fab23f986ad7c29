"""The README's example prompts: each table answer is the truth (`tasks.solve` reads it from
the prompt), and the shipped pair gives it (capture + readout in this process, as served)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stateblock.engines import LaneRequest, create_engine
from stateblock.model.loading import load_serving_model
from stateblock.train.tasks import solve

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([a-z]+: [^`]*)` \| `([^`]*)`[^|]*\|", re.M)


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
