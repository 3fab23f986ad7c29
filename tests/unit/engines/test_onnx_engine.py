"""The `onnx` readout engine on the shipped reference model: same answers as `reference`,
and a start-up that fails closed on a missing, corrupt or foreign graph.

The shipped decoder is copied to a temporary directory and exported there once, through
the CLI (`stateblock export`, default path `<decoder>/readout.onnx`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

from stateblock.app.cli import main as cli_main
from stateblock.engines import LaneRequest, create_engine
from stateblock.engines.onnx_engine import OnnxEngine
from stateblock.engines.onnx_graph import (
    GRAPH_FILE,
    OnnxGraphError,
    OnnxGraphMismatch,
    file_sha256,
    manifest_path,
)
from stateblock.model.loading import load_serving_model
from stateblock.model.vocab import NO_EOS
from stateblock.protocol.sampling import sampling_params
from stateblock.train.tasks import generate
from tests.helpers import REFERENCE_BASE, REFERENCE_DECODER

NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("decoder")
    for f in ("decoder.safetensors", "manifest.json"):
        shutil.copy(REFERENCE_DECODER / f, d / f)
    assert cli_main(["export", "--decoder", str(d), "--base", str(REFERENCE_BASE)]) == 0
    return d


@pytest.fixture(scope="module")
def model(decoder_dir):
    return load_serving_model("stateblock-reference", REFERENCE_BASE, decoder_dir)


@pytest.fixture(scope="module")
def engines(model):
    onnx_engine = create_engine("onnx", model)
    onnx_engine.warm_up()
    return create_engine("reference", model), onnx_engine


@pytest.fixture(scope="module")
def prompt_rows(model) -> list[torch.Tensor]:
    """Captured rows of real held-out prompts (unequal lengths)."""
    return [model.prompt_rows(ex.prompt) for ex in generate(4, split="heldout", seed=7)]


def assert_same_answers(ref, got) -> None:
    for r, g in zip(ref, got, strict=True):
        diff = max((abs(a - b) for a, b in zip(r.margins, g.margins, strict=False)), default=0.0)
        print(f"lane: {len(r.token_ids)} tokens, margin max abs diff {diff:.2e}")
        assert diff < 1e-3
        if r.token_ids == g.token_ids and r.eos_pos == g.eos_pos:
            continue
        # not autoregressive: a position's token does not depend on earlier tokens, so any
        # difference must sit on a reference near tie, position by position
        for t, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=False)):
            assert a == b or r.margins[t] < NEAR_TIE, f"position {t}: {a} vs {b} off a near tie"
        cut = min(r.eos_pos, g.eos_pos)
        assert cut == NO_EOS or r.margins[cut] < NEAR_TIE, "EOS moved off a near tie"


def test_shipped_graph_has_no_baked_lm_head_and_no_fused_attention(decoder_dir, model):
    graph = onnx.load(str(decoder_dir / GRAPH_FILE))
    onnx.checker.check_model(graph)
    ops = {n.op_type for n in graph.graph.node}
    assert "Softmax" in ops and not any("attention" in op.lower() for op in ops)
    assert "lm_head" in {i.name for i in graph.graph.input}
    lm = model.lm_head.detach().float().numpy()
    for init in graph.graph.initializer:  # latent slots share its (64, 256) shape: values
        arr = onnx.numpy_helper.to_array(init)
        for cand in (arr, arr.T) if arr.ndim == 2 else ():
            assert cand.shape != lm.shape or not np.allclose(cand, lm), init.name
    manifest = json.loads(manifest_path(decoder_dir / GRAPH_FILE).read_text())
    assert manifest["decoder_digest"] == model.identity.decoder_digest.hex()
    assert manifest["base_model_digest"] == model.identity.base_model_digest.hex()
    assert manifest["lm_head_digest"] == model.identity.lm_head_digest.hex()
    assert manifest["tokenizer_digest"] == model.manifest["tokenizer_digest"]


def test_onnx_engine_answers_like_reference_greedy(engines, prompt_rows):
    reference, onnx_engine = engines
    assert onnx_engine.name == "onnx" and onnx_engine.identity == reference.identity
    lanes = [
        LaneRequest(rows=r, depth=d) for r, d in zip(prompt_rows, (128, 37, 64, 1), strict=True)
    ]
    assert_same_answers(reference.readout(lanes), onnx_engine.readout(lanes))


def test_onnx_engine_samples_like_reference_with_seeds(engines, prompt_rows):
    reference, onnx_engine = engines
    lanes = [
        LaneRequest(rows=prompt_rows[0], depth=96, sampling=sampling_params(1.5, 3)),
        LaneRequest(rows=prompt_rows[1], depth=64),
        LaneRequest(rows=prompt_rows[2], depth=80, sampling=sampling_params(0.8, 9)),
    ]
    ref, got = reference.readout(lanes), onnx_engine.readout(lanes)
    assert_same_answers(ref, got)
    greedy = onnx_engine.readout([replace(lanes[0], sampling=sampling_params(0.0))])
    assert got[0].token_ids != greedy[0].token_ids  # the seeded lane really sampled


def test_lane_groups_under_a_small_score_budget_answer_the_same(model, engines, prompt_rows):
    _, onnx_engine = engines
    split = OnnxEngine(model, onnx_engine.graph_path, score_budget=1)  # one lane per run
    lanes = [
        LaneRequest(rows=r, depth=d) for r, d in zip(prompt_rows, (50, 140, 9, 70), strict=True)
    ]
    assert split._groups(lanes) == [[0], [1], [2], [3]]
    assert split.readout(lanes) == onnx_engine.readout(lanes)


def _graph_copy(decoder_dir, tmp_path):
    d = tmp_path / "graphs"
    d.mkdir()
    for src in (decoder_dir / GRAPH_FILE, manifest_path(decoder_dir / GRAPH_FILE)):
        shutil.copy(src, d / src.name)
    return d / GRAPH_FILE


def test_missing_graph_fails_closed_and_names_the_export_command(model, tmp_path):
    bare = replace(model, decoder_dir=tmp_path)  # a decoder directory never exported
    with pytest.raises(OnnxGraphError, match="stateblock export"):
        create_engine("onnx", bare)


def test_graph_for_another_base_model_fails_closed(model, decoder_dir, tmp_path):
    path = _graph_copy(decoder_dir, tmp_path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["base_model_digest"] = "0" * 64
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(OnnxGraphMismatch, match="base_model_digest") as e:
        OnnxEngine.load(model, graph_path=path)
    assert e.value.field == "base_model_digest"


def test_corrupt_graph_fails_closed(model, decoder_dir, tmp_path):
    path = _graph_copy(decoder_dir, tmp_path)
    path.write_bytes(path.read_bytes()[: 1 << 16])  # truncated
    with pytest.raises(OnnxGraphError, match="SHA-256"):
        OnnxEngine.load(model, graph_path=path)
    # a manifest rewritten to match still does not get a broken graph past ONNX Runtime
    manifest = json.loads(manifest_path(path).read_text())
    manifest["onnx_sha256"] = file_sha256(path)
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(OnnxGraphError, match="ONNX Runtime cannot load"):
        OnnxEngine.load(model, graph_path=path)


def test_unreadable_manifest_fails_closed(model, decoder_dir, tmp_path):
    path = _graph_copy(decoder_dir, tmp_path)
    manifest_path(path).write_text("{not json")
    with pytest.raises(OnnxGraphError, match="cannot read ONNX graph manifest"):
        OnnxEngine.load(model, graph_path=path)
