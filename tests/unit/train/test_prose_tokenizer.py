"""The prose tokenizer (`stateblock.train.prose_tokenizer`): a byte-level BPE trained on the
committed sample's train split, saved in the `from_pretrained` layout and loaded the way the
services load a base's tokenizer; held-out text round-trips exactly, `<eos>` and the other
specials keep the reference tokenizer's ids, and the capture's prompt encoding is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stateblock.model.prompts import PromptEncoder
from stateblock.runtime import REFERENCE_BASE
from stateblock.train import corpus, prose_tokenizer
from stateblock.train.tokenizer import ANS, BOS, EOS, SPECIALS

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample" / "docs.jsonl"
VOCAB = 2048
EDGES = [
    "",
    " ",
    "  two leading spaces and trailing ones   ",
    "tabs\tand\nnewlines\r\n\n\nand blank lines",
    "héllo wörld ✓ 日本 🙂 – “quoted” — naïve café",
    "UPPER case !@#$%^&*() 0123456789 0x7fff_ffff",
    "\x00 control \x1b[0m bytes \ufeff",
]


@pytest.fixture(scope="module")
def split_sample() -> tuple[list[str], list[str]]:
    train, heldout = corpus.split(corpus.load_sample(SAMPLE), share=0.25)
    return [d.text for d in train], [d.text for d in heldout]


@pytest.fixture(scope="module")
def tok_dir(split_sample, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prose-base")
    prose_tokenizer.save_bpe(prose_tokenizer.train_bpe(split_sample[0], VOCAB), out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def test_saved_in_the_reference_layout_with_the_vocabulary_asked_for(tok_dir, tok):
    reference = sorted(p.name for p in REFERENCE_BASE.glob("tok*")) + ["chat_template.jinja"]
    assert set(reference) <= {p.name for p in tok_dir.iterdir()}
    assert len(tok) == VOCAB
    assert json.loads((tok_dir / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_heldout_text_round_trips_exactly(split_sample, tok):
    heldout = split_sample[1]
    assert heldout
    for text in heldout + EDGES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.unk_token_id not in tok("🙂 \x00 日本", add_special_tokens=False)["input_ids"]


def test_specials_keep_the_reference_ids_and_eos_ends_a_document(tok):
    reference = AutoTokenizer.from_pretrained(str(REFERENCE_BASE), local_files_only=True)
    assert tok.convert_tokens_to_ids(SPECIALS) == reference.convert_tokens_to_ids(SPECIALS)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, reference.pad_token)
    text = "The module reads files."
    body = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id not in body
    doc = body + [tok.eos_token_id]  # how a training document ends
    assert tok.decode(doc) == text + EOS
    assert tok.decode(doc, skip_special_tokens=True) == text
    # the literal "<eos>" in text is the one EOS token, as in the reference tokenizer
    assert tok(EOS, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]


def test_a_prompt_is_framed_as_the_capture_expects(tok):
    ids = tok("Quote the sentence after this one.")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids(ANS)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert chat == f"{BOS}Hi{ANS}"
    encode = PromptEncoder(tok)
    assert encode.direct
    for prompt in EDGES + ["glued<bos>specials<eos>", "Python’s open() returns a file."]:
        assert encode(prompt) == tok(prompt)["input_ids"], prompt


def test_the_cli_trains_saves_and_measures_on_the_heldout_split(split_sample, tmp_path):
    data = tmp_path / "prose"
    data.mkdir()
    for name, texts in zip(("train", "heldout"), split_sample, strict=True):
        docs = [corpus.Doc(str(k), t.split("\n")) for k, t in enumerate(texts)]
        corpus.write_documents(docs, data / f"{name}.txt")
    out = tmp_path / "base"
    argv = ["--corpus", str(data), "--out", str(out), "--vocab-size", "1024"]
    assert prose_tokenizer.main(argv) == 0
    stats = json.loads((out / "tokenizer_stats.json").read_text())
    held = stats["heldout"]
    assert stats["vocab_size"] == 1024 and held["documents"] == len(split_sample[1])
    assert held["roundtrip"] == held["documents"]
    assert held["bytes_per_token"] > 2.5 and 1 < held["tokens_per_word"] < 3


def test_a_vocabulary_without_room_for_merges_is_refused():
    with pytest.raises(ValueError, match="vocab_size must exceed 261"):
        prose_tokenizer.train_bpe(["some text"], vocab_size=200)
