"""The prose base's GPU stage on the CPU: `prose_shards` turns the committed sample into the
uint16 streams a device call carries, and `prose_stage` (the entry point `bench/gpu_session.sh
prose` runs) trains a tiny Llama on them end to end: the held-out loss falls from uniform, the
summary and the weights are written, and a later stage starts from those weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from stateblock.train import corpus, prose_eval, prose_shards, prose_stage, prose_tokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample" / "docs.jsonl"
VOCAB = 1024
TINY = ["--dim", "64", "--mlp-dim", "128", "--n-layers", "2", "--n-heads", "4",
        "--seq-len", "32", "--budget", "512", "--lr", "5e-3", "--warmup", "5"]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The sample split a quarter held out, a 1,024-token BPE, and the stage's data folder."""
    root = tmp_path_factory.mktemp("prose-shards")
    train, heldout = corpus.split(corpus.load_sample(SAMPLE), share=0.25)
    corpus.write_documents(train, root / "train.txt")
    corpus.write_documents(heldout, root / "heldout.txt")
    tok = prose_tokenizer.train_bpe(corpus.read_documents(root / "train.txt"), VOCAB)
    prose_tokenizer.save_bpe(tok, root / "tokenizer")
    prose_shards.main(["--corpus", str(root), "--tokenizer", str(root / "tokenizer"),
                       "--out", str(root / "data")])  # fmt: skip
    return root / "data"


def _stage(data: Path, out: Path, *extra: str) -> dict:
    args = ["--data", str(data), "--out", str(out), "--device", "cpu", "--compile", "off",
            "--minutes", "10", "--samples", "4", "--evals-per-epoch", "10"]  # fmt: skip
    prose_stage.main([*args, *TINY, *extra])
    return json.loads((out / "summary.json").read_text())


def test_the_shards_are_the_documents_as_uint16_ids(shards):
    from transformers import AutoTokenizer

    meta = json.loads((shards / "meta.json").read_text())
    docs = corpus.read_documents(shards.parent / "heldout.txt")
    ids = np.load(shards / "heldout.npy")
    assert ids.dtype == np.uint16 and meta["vocab_size"] == VOCAB
    assert meta["splits"]["heldout"] == {
        "documents": len(docs), "tokens": ids.size,
        "bytes": sum(len(d.encode()) for d in docs), "words": sum(len(d.split()) for d in docs),
    }  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(shards / "tokenizer"), local_files_only=True)
    stream = ids.tolist()
    bos = [i for i, t in enumerate(stream) if t == meta["bos"]]
    assert len(bos) == len(docs) and stream[-1] == meta["eos"]
    first = stream[bos[0] + 1 : bos[1] - 1]  # between <bos> and <eos>
    assert tok.decode(first) == docs[0]


def test_the_train_ids_made_again_on_the_machine_are_the_ones_counted(shards, tmp_path):
    """A folder that travels without train.npy: `--splits train` with its own tokenizer
    makes the same ids from the text; another tokenizer, or other text, is refused."""
    import shutil

    folder = tmp_path / "carried"
    shutil.copytree(shards, folder)
    (folder / "train.npy").unlink()
    args = ["--corpus", str(shards.parent), "--tokenizer", str(folder / "tokenizer"),
            "--out", str(folder), "--splits", "train"]  # fmt: skip
    prose_shards.main(args)
    assert np.array_equal(np.load(folder / "train.npy"), np.load(shards / "train.npy"))
    assert (folder / "meta.json").read_text() == (shards / "meta.json").read_text()
    other = tmp_path / "other"
    other.mkdir()
    docs = corpus.read_documents(shards.parent / "train.txt")
    corpus.write_documents([corpus.Doc("x", [d]) for d in docs[1:]], other / "train.txt")
    with pytest.raises(ValueError, match="against meta.json's"):
        prose_shards.main([*args[:1], str(other), *args[2:]])
    assert np.array_equal(np.load(folder / "train.npy"), np.load(shards / "train.npy"))
    tok = json.loads((folder / "tokenizer" / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zz-not-a-token"] = VOCAB + 7
    (folder / "tokenizer" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="not the one meta.json counted with"):
        prose_shards.main(args)


def test_the_stage_trains_scores_and_saves(shards, tmp_path):
    s = _stage(shards, tmp_path / "one", "--epochs", "0.2,0.4")
    assert abs(s["start"]["nll"] - math.log(VOCAB)) < 0.5  # about uniform before training
    assert [a["steps"] for a in s["arms"]] == [a["steps_planned"] for a in s["arms"]] == [15, 30]
    assert not any(a["stopped_by_clock"] for a in s["arms"])
    longer = s["arms"][1]
    assert longer["best"]["nll"] < s["start"]["nll"] - 0.5  # 6.94 -> about 6.0 on this config
    assert longer["curve"][-1]["train_nll"] < longer["curve"][0]["train_nll"]
    assert s["best"]["arm"] == 1 and s["best"]["nll"] == longer["best"]["nll"]
    held = s["data"]["splits"]["heldout"]
    n_docs = held["documents"]
    assert s["start"]["tokens"] == held["tokens"] - n_docs  # every token but the <bos>s
    bits = s["best"]["nll"] * s["best"]["tokens"] / math.log(2)
    assert s["best"]["bits_per_byte"] == pytest.approx(bits / held["bytes"], rel=1e-3)
    assert s["checkpoint"] == {"saved": True, "mb": 0.4, "prefix": "base", "parts": 1}
    assert (tmp_path / "one" / "base.part0.safetensors").is_file()
    assert s["continuations"]["n"] == 4 and 0 < s["continuations"]["distinct4"] <= 1
    assert "| 1 | 0.4 |" in (tmp_path / "one" / "summary.md").read_text()


def test_a_later_stage_starts_from_the_saved_weights(shards, tmp_path):
    first = _stage(shards, tmp_path / "one", "--epochs", "0.3")
    init = str(tmp_path / "one" / "base")
    later = _stage(shards, tmp_path / "two", "--epochs", "0.1", "--init", init,
                   "--max-checkpoint-mb", "0.1")  # fmt: skip
    assert later["start"]["nll"] == pytest.approx(first["best"]["nll"], abs=0.02)  # bf16 weights
    assert later["train"]["init"] == init
    assert (
        later["checkpoint"]["saved"] is False and "max-checkpoint-mb" in later["checkpoint"]["why"]
    )
    assert not list((tmp_path / "two").glob("base.part*"))


def test_the_gpu_shape_is_the_recipe_prose_base():
    a = prose_stage.parse_args(["--data", "d", "--out", "o"])
    assert (a.dim, a.n_layers, a.seq_len, a.budget, a.arms) == (384, 6, 512, 65536, [4, 12, 30])
    arm = prose_stage.plan_arm(a, epochs=30, seconds=100, pace=0.05, tokens=11_000_000)
    assert arm.steps == 1800  # the clock's cap (0.9 * 100 s / 50 ms), under 30 passes' 5,035
    assert arm.warmup == 180 and arm.every == 84  # a tenth of the arm at most; half a pass


def test_bad_arms_are_refused(capsys):
    with pytest.raises(SystemExit):
        prose_stage.parse_args(["--data", "d", "--out", "o", "--epochs", "4,x"])
    assert "--epochs: comma-separated numbers" in capsys.readouterr().err


def test_scoring_skips_bos_labels_and_windows_cover_the_stream():
    class Uniform(torch.nn.Module):
        def forward(self, input_ids):
            shape = (*input_ids.shape, 8)
            return type("Out", (), {"logits": torch.zeros(shape)})()

    ids = torch.tensor([1, 5, 6, 7, 2, 1, 4, 2, 1, 3, 2], dtype=torch.int32)
    nll, tokens = prose_eval.score(Uniform(), ids, seq_len=4, bos=1)
    assert tokens == 8 and nll == pytest.approx(8 * math.log(8))  # 10 labels, 2 of them <bos>
    assert prose_eval.distinct([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(4 / 5)
