"""The gateway decodes with `tokenizers` alone; the text must be transformers' own."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from gateway.detokenizer import Detokenizer
from tests.helpers import REFERENCE_BASE


def test_decode_equals_transformers(detokenizer):
    reference = AutoTokenizer.from_pretrained(str(REFERENCE_BASE), local_files_only=True)
    rng = random.Random(0)
    vocab = len(reference)
    cases = [[], [reference.eos_token_id], [reference.bos_token_id, 20, 21]]
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in cases:
        assert detokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), ids


def test_clean_up_spaces_as_transformers_does(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((REFERENCE_BASE / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"clean_up_tokenization_spaces": true}')
    tok = Detokenizer.load(tmp_path)
    ids = tok._tok.encode("a , b .", add_special_tokens=False).ids
    assert tok.decode(ids) == "a, b."
