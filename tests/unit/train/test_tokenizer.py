"""The capture's prompt encoding: the Rust backend's ids are exactly `tok(prompt)`'s, special
tokens included, for the shipped reference tokenizer and the bench's, in memory and as the
services load them from disk; any tokenizer state the shortcut does not reproduce goes
through `tok(prompt)`."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bench.models import bench_prompt, bench_tokenizer
from stateblock.model.prompts import PromptEncoder
from stateblock.runtime import REFERENCE_BASE
from stateblock.train.tasks import generate

EDGES = [
    "",
    " ",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\r\n",
    "<bos>",
    "<eos> in the middle <pad> and <unk> and <ans>",
    "glued<bos>specials<eos>",
    "héllo wörld ✓ 日本 🙂",
    "copy: sort: add: count:",
    "UPPER case !@#$%^&*()",
]


def _loaded(tok, tmp_path_factory) -> PreTrainedTokenizerFast:
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True)


@pytest.fixture(scope="module", params=["reference", "bench", "bench-from-disk"])
def tokenizer_and_prompts(request, tmp_path_factory):
    rng = random.Random(0)
    if request.param == "reference":
        tok = AutoTokenizer.from_pretrained(str(REFERENCE_BASE), local_files_only=True)
        prompts = [ex.prompt for ex in generate(200, split="train", seed=1)]
    else:
        tok = bench_tokenizer(2048)
        if request.param == "bench-from-disk":
            tok = _loaded(tok, tmp_path_factory)
        prompts = [bench_prompt(rng, n, 2048) for n in (1, 2, 17, 512, 4096)]
        prompts += ["w4 w5 w99999 w2047 w2048 nonsense", "w12  w13\tw14\nw15"]
    return tok, prompts + EDGES


def test_backend_ids_equal_the_transformers_call(tokenizer_and_prompts):
    tok, prompts = tokenizer_and_prompts
    encode = PromptEncoder(tok)
    assert encode.direct  # both tokenizers are plain fast ones: the shortcut is taken
    for prompt in prompts:
        assert encode(prompt) == tok(prompt)["input_ids"], prompt
    assert encode("w7")[0] == tok.bos_token_id  # the post-processor's specials are there


def test_a_backend_left_truncating_goes_through_the_transformers_call(tmp_path_factory):
    tok = bench_tokenizer(2048)
    prompt = bench_prompt(random.Random(1), 40, 2048)
    full = tok(prompt)["input_ids"]
    tok.backend_tokenizer.enable_truncation(8)  # `tok(prompt)` would not truncate
    encode = PromptEncoder(tok)
    assert not encode.direct
    assert encode(prompt) == full
    assert encode.direct  # that call reset the backend, so the next one goes direct


def test_split_special_tokens_goes_through_the_transformers_call():
    tok = AutoTokenizer.from_pretrained(str(REFERENCE_BASE), local_files_only=True)
    special = tok("<eos>1")["input_ids"]
    tok.split_special_tokens = True  # "<eos>" is then five characters of text
    encode = PromptEncoder(tok)
    assert not encode.direct
    assert encode("<eos>1") == tok("<eos>1")["input_ids"]
    assert len(encode("<eos>1")) > len(special)


def test_a_tokenizer_class_that_overrides_the_encoding_is_not_bypassed():
    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper(), *args, **kwargs)

    base = bench_tokenizer(2048)
    tok = Shouting(tokenizer_object=base.backend_tokenizer, bos_token="<bos>", unk_token="<unk>")
    encode = PromptEncoder(tok)
    assert not encode.direct
    assert encode("w5 w6") == tok("w5 w6")["input_ids"] == [1, 3, 3]  # W5 W6: unknown words
