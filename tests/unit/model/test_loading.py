"""What each service loads of the base model: the capture all of it, a readout worker its
lm_head alone, both with the same identity, checked once against the decoder manifest."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from stateblock.model.checkpoint import DecoderError, DecoderMismatch
from stateblock.model.loading import load_lm_head, load_readout_model, load_serving_model
from tests.helpers import REFERENCE_BASE, REFERENCE_DECODER


def test_a_readout_worker_loads_the_lm_head_alone_with_the_same_identity():
    full = load_serving_model("m", REFERENCE_BASE, REFERENCE_DECODER)
    head_only = load_readout_model("m", REFERENCE_BASE, REFERENCE_DECODER)
    assert head_only.model is None and head_only.tokenizer is None
    assert torch.equal(head_only.lm_head, full.lm_head)
    assert head_only.identity == full.identity
    assert head_only.manifest == full.manifest


def test_the_lm_head_slice_is_the_models_output_embedding_in_any_dtype():
    full = load_serving_model("m", REFERENCE_BASE, REFERENCE_DECODER)
    bf16 = load_lm_head(REFERENCE_BASE, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == full.lm_head.shape
    assert torch.equal(bf16.float(), full.lm_head)  # stored in bf16: exact either way


def test_a_tied_model_reads_its_input_embedding(tmp_path):
    base = tmp_path / "tied"
    shutil.copytree(REFERENCE_BASE, base)
    weights = load_file(str(base / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(base / "model.safetensors"))
    with pytest.raises(DecoderError, match="no lm_head.weight in"):  # untied: no fallback
        load_lm_head(base)
    config = base / "config.json"
    config.write_text(config.read_text().replace('"tie_word_embeddings": false', '"x": 0'))
    head = load_lm_head(base)  # unset: transformers' default ties them
    assert torch.equal(head, weights["model.embed_tokens.weight"].float())


def test_a_readout_worker_refuses_a_decoder_of_another_base(tmp_path):
    base = tmp_path / "other"
    shutil.copytree(REFERENCE_BASE, base)
    weights = load_file(str(base / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2
    save_file(weights, str(base / "model.safetensors"))
    with pytest.raises(DecoderMismatch, match="base_model_digest"):
        load_readout_model("m", base, REFERENCE_DECODER)


def test_a_missing_base_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no base model directory"):
        load_readout_model("m", tmp_path / "nowhere", REFERENCE_DECODER)
