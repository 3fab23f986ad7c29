"""`base_ddp --corpus`: the base trainer on prose. A tiny Llama trained on the committed
sample's train split with the prose tokenizer: its held-out loss falls, the run resumes from
its state file, and the base directory loads like any base (the tokenizer's ids, the
vocabulary's size), with the token caches kept beside it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from stateblock.model.loading import load_base
from stateblock.train import base_ddp, corpus, prose_tokenizer, recipe

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample" / "docs.jsonl"
VOCAB = 1024


class _Exited(BaseException):
    pass


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus dir, tokenizer dir) from the sample, a quarter of it held out."""
    root = tmp_path_factory.mktemp("prose")
    train, heldout = corpus.split(corpus.load_sample(SAMPLE), share=0.25)
    corpus.write_documents(train, root / "train.txt")
    corpus.write_documents(heldout, root / "heldout.txt")
    tok = prose_tokenizer.train_bpe(corpus.read_documents(root / "train.txt"), VOCAB)
    prose_tokenizer.save_bpe(tok, root / "tokenizer")
    return root, root / "tokenizer"


def _run(out: Path, prose: tuple[Path, Path], steps: int, monkeypatch) -> dict:
    """The recipe's tiny prose stage, in this process, for `steps` steps."""
    data, tok = prose
    cmd = recipe.prose_base(data, tok, out.parent, ngpu=0, minutes=5, tiny=True)
    args = [*cmd[3:], "--workers", "0", "--eval-tokens", "4096", "--max-steps", str(steps)]

    def no_exit(code: int) -> None:  # main() ends with os._exit (its loader workers)
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", no_exit)
    with pytest.raises(_Exited):
        base_ddp.main(args)
    return json.loads((out / "base_stats.json").read_text())


def test_a_tiny_base_learns_the_sample_and_loads_as_a_base(tmp_path, prose, monkeypatch):
    run = tmp_path / "prose-base-run"
    first = _run(run, prose, 1, monkeypatch)
    assert first["steps"] == 1
    assert abs(first["heldout"]["nll"] - math.log(VOCAB)) < 0.5  # about uniform at the start
    later = _run(run, prose, 40, monkeypatch)
    assert later["steps"] == 41 and later["steps_this_run"] == 40  # resumed from its state
    assert later["heldout"]["tokens"] == first["heldout"]["tokens"] == 4096
    assert later["heldout"]["nll"] < first["heldout"]["nll"] - 0.5  # 6.93 -> 5.84 on this config
    model, tok = load_base(run / "base")
    assert model.config.vocab_size == len(tok) == VOCAB
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert sorted(p.name for p in (run / "base").glob("*.ids.pt")) == []
    assert len(list(run.glob("*.ids.pt"))) == 2  # the two splits' token caches
    ids = tok("The module", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], VOCAB)


def test_windows_predict_the_next_token_of_the_stream(tmp_path):
    stream = torch.arange(1000, dtype=torch.int32)
    torch.save(stream, tmp_path / "ids.pt")
    windows = base_ddp.prose_data.TextWindows(tmp_path / "ids.pt", 16, 4, seed="7")
    (x, y), (x2, _) = next(iter(windows)), next(iter(windows))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # every label is the token after its position
    assert torch.equal(x, x2)  # the same seed draws the same windows


class _Vocab:
    """What `build_model` reads of a tokenizer: its size and special ids."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return prose_tokenizer.VOCAB_SIZE


def test_the_gpu_prose_base_is_tens_of_millions_of_parameters():
    cmd = recipe.prose_base(Path("c"), Path("t"), Path("w"), ngpu=2, minutes=8)
    assert cmd[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"]
    a = base_ddp.parse_args(cmd[5:])
    assert a.corpus == "c" and a.tokenizer == "t" and a.state == str(Path("w/prose-base-state.pt"))
    with torch.device("meta"):
        model = base_ddp.build_model(_Vocab(), a)
    assert model.config.vocab_size == prose_tokenizer.VOCAB_SIZE
    assert 10e6 < sum(p.numel() for p in model.parameters()) < 100e6


def test_a_corpus_without_its_tokenizer_is_refused(capsys):
    with pytest.raises(SystemExit):
        base_ddp.parse_args(["--out", "x", "--corpus", "data/prose"])
    assert "--corpus and --tokenizer go together" in capsys.readouterr().err
