"""The prose tuning across runs: a tuning stopped by its call budget leaves its state, and the
next run goes on from it to the weights one run would have given, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stateblock.train import base_ddp, corpus, prose_tasks, prose_tokenizer, prose_tune
from stateblock.train.prose_readout import SCALES

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample" / "docs.jsonl"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, list[prose_tasks.Example]]:
    """A tiny untrained base in the `from_pretrained` layout, and prompts to tune it on."""
    from transformers import AutoTokenizer

    docs = [d.text for d in corpus.load_sample(SAMPLE)]
    scale = SCALES["tiny"]
    root = tmp_path_factory.mktemp("tune")
    prose_tokenizer.save_bpe(prose_tokenizer.train_bpe(docs, scale.vocab_size), root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"), local_files_only=True)
    torch.manual_seed(0)
    shape = base_ddp.parse_args(["--out", "-", "--corpus", "-", "--tokenizer", "-",
                                 *scale.base_args.split()])  # fmt: skip
    model = base_ddp.build_model(tok, shape)
    model.save_pretrained(str(root / "base"), safe_serialization=True)
    tok.save_pretrained(str(root / "base"))
    return root / "base", prose_tasks.generate(docs, 40, seed=1)


def ticks(seconds: float = 1.0):
    """A clock that moves `seconds` each time it is read."""
    now = [0.0]

    def clock() -> float:
        now[0] += seconds
        return now[0]

    return clock


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_stopped_tuning_goes_on_to_the_weights_of_one_run(base, tmp_path):
    base_dir, examples = base
    cfg = prose_tune.TuneConfig(steps=9, token_budget=2048, lr=3e-3, warmup=2)
    whole = prose_tune.tune(base_dir, examples, tmp_path / "one" / "tuned", cfg, clock=ticks())
    assert whole["finished"] and whole["steps"] == 9 and whole["resumed_at"] == 0

    out = tmp_path / "two" / "tuned"
    # a second a read: the budget of 4 s stops the run after a few steps
    stopped = prose_tune.TuneConfig(**{**cfg.__dict__, "call_minutes": 4 / 60})
    first = prose_tune.tune(base_dir, examples, out, stopped, clock=ticks())
    assert not first["finished"] and 0 < first["step"] < 9
    assert not out.exists() and prose_tune.resume_path(out).is_file()
    second = prose_tune.tune(base_dir, examples, out, cfg, clock=ticks())
    assert second["finished"] and second["resumed_at"] == first["step"]
    assert not prose_tune.resume_path(out).exists()
    assert second["final_loss"] == whole["final_loss"]
    a, b = weights(tmp_path / "one" / "tuned"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_chain_whose_tuning_stopped_goes_no_further(tmp_path, monkeypatch):
    """The chain's later stages wait for the tuned base: a run whose tuning stopped for its
    call budget ends there, as a success, and leaves the rest to the next run."""
    from stateblock.train import prose_readout

    monkeypatch.setattr(prose_readout, "stage_tasks", lambda *a: tmp_path / "tasks")
    monkeypatch.setattr(prose_readout, "stage_base", lambda *a: tmp_path / "base")
    monkeypatch.setattr(prose_readout, "stage_tune", lambda *a: None)

    def not_yet(*a):
        raise AssertionError("a stage after a stopped tuning ran")

    for stage in ("stage_teacher", "stage_distil", "stage_eval"):
        monkeypatch.setattr(prose_readout, stage, not_yet)
    args = ["--work", str(tmp_path / "w"), "--scale", "tiny", "--tune-call-minutes", "4.5"]
    assert prose_readout.main(args) == 0
    a = prose_readout.parser().parse_args(args)
    assert prose_readout.with_overrides(SCALES["tiny"], a).tune.call_minutes == 4.5
