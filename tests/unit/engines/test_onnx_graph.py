"""ONNX export of the readout graph: structure, manifest, and ORT parity with the decoder.

A small random decoder, exported once; parity runs at shapes other than the trace shapes
(lanes 2, prompt 5, depth 7), so any size baked into the graph shows up as a failure.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from stateblock.engines.onnx_graph import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    OnnxGraphError,
    export_readout,
    manifest_path,
)
from stateblock.model.decoder import NO_EOS, ReadoutConfig, ReadoutDecoder
from stateblock.model.vocab import Filters, gumbel_noise, no_filters
from stateblock.tools import tensorrt_build

# V not divisible by the 8 chunks, and the last chunk (7 ids) narrower than the top-8
D_BASE, VOCAB, EOS = 32, 70, 3
FUSED_ATTENTION = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "SDPA"}
IDENTITY = {
    "decoder_digest": "d" * 64,
    "base_model_digest": "b" * 64,
    "lm_head_digest": "1" * 64,
    "tokenizer_digest": "7" * 64,
}


# the shipped architecture's options: rows attended by every position, in-graph refinement;
# and a refinement stack deeper than the first
@pytest.fixture(
    scope="module",
    params=[{}, {"row_attn": True, "refine": 1}, {"row_attn": True, "refine": 1, "n_ref_mixer": 3}],
    ids=["plain", "refine", "deeper-refine"],
)
def decoder(request) -> ReadoutDecoder:
    torch.manual_seed(0)
    cfg = ReadoutConfig(
        d_base=D_BASE,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        d_r=32,
        n_latent=4,
        n_heads=4,
        n_mixer=2,
        **request.param,
    )
    dec = ReadoutDecoder(cfg).eval()
    with torch.no_grad():  # larger weights than init so outputs vary by position and lane
        for p in dec.parameters():
            p.normal_(0, 0.3)
    return dec


@pytest.fixture(scope="module")
def exported(decoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    manifest = export_readout(decoder, path, identity=IDENTITY)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return path, manifest, session


def run_both(decoder, session, rows, lens, depths, lm_head, temperature, noise, filters=None):
    k, d = len(depths), int(max(depths))
    pos = torch.arange(d).expand(k, d).contiguous()
    depths = torch.tensor(depths)
    filters = filters or no_filters(k)
    with torch.no_grad():  # the eager reference: default (sdpa) attention, as served
        ref = decoder(rows, lens, pos, depths, lm_head, EOS, temperature, noise, filters=filters)
    feeds = {
        "rows": rows.numpy(),
        "prompt_lens": lens.numpy(),
        "positions": pos.numpy(),
        "depths": depths.numpy(),
        "lm_head": lm_head.numpy(),
        "eos_token_id": np.array([EOS]),
        "temperature": temperature.numpy(),
        "noise": noise.numpy(),
        **{
            n: f.numpy()
            for n, f in zip(("top_k", "top_p", "min_p", "min_tokens"), filters, strict=True)
        },
    }
    got = [torch.from_numpy(x) for x in session.run(list(OUTPUT_NAMES), feeds)]
    return ref, got


def assert_parity(ref, got, depths, tie: float = 1e-3) -> None:
    tokens, top1, top2, margin, eos_pos, top1_lp, token_lp = got
    # exact log-probabilities: the in-graph online log-sum-exp equals the eager one, to fp32
    # rounding (a sampled token can sit some -400 nats down, where one ulp is 3e-5 and the
    # summation order of the host's kernels moves it a few ulps)
    torch.testing.assert_close(top1_lp, ref.top1_logprob, atol=1e-4, rtol=1e-6)
    same = tokens == ref.tokens
    torch.testing.assert_close(token_lp[same], ref.token_logprob[same], atol=1e-4, rtol=1e-6)
    assert bool((token_lp <= 1e-6).all()) and bool((token_lp <= top1_lp + 1e-6).all())
    diff = (margin - ref.margin).abs().max().item()
    print(f"ORT vs eager: margin max abs diff {diff:.2e}")
    assert diff < 1e-4 * max(1.0, ref.margin.abs().max().item())
    # a token may differ only where the reference top-1/top-2 is a near tie
    for name, a, b in (("top1", ref.top1, top1), ("tokens", ref.tokens, tokens)):
        off = a != b
        assert bool((ref.margin[off] < tie).all()), f"{name} differs off a near tie"
    assert torch.equal(ref.top2[ref.margin >= tie], top2[ref.margin >= tie])
    for k, d in enumerate(depths):
        assert eos_pos[k].item() == ref.eos_pos[k].item()
        assert ref.eos_pos[k].item() == NO_EOS or ref.eos_pos[k].item() < d


def lanes(k: int, lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, max(lens), D_BASE, generator=g)
    return rows, torch.tensor(lens), torch.randn(VOCAB, D_BASE, generator=g)


def test_graph_is_opset17_explicit_attention_with_lm_head_as_input(exported):
    path, _, _ = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    ops = {n.op_type for n in model.graph.node}
    assert not ops & FUSED_ATTENTION and not any("attention" in op.lower() for op in ops)
    assert {"MatMul", "Softmax", "TopK", "Sin", "Cos", "ReduceMin"} <= ops
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)  # no custom ops
    inputs = {i.name: i for i in model.graph.input}
    assert tuple(inputs) == INPUT_NAMES
    assert tuple(o.name for o in model.graph.output) == OUTPUT_NAMES
    lm = [d.dim_value for d in inputs["lm_head"].type.tensor_type.shape.dim]
    assert lm == [VOCAB, D_BASE]
    shapes = {tuple(t.dims) for t in model.graph.initializer}
    assert (VOCAB, D_BASE) not in shapes and (D_BASE, VOCAB) not in shapes
    assert "lm_head" not in {t.name for t in model.graph.initializer}
    dims = {n: [d.dim_param for d in i.type.tensor_type.shape.dim] for n, i in inputs.items()}
    assert dims["rows"][:2] == ["lanes", "prompt_len"]
    assert dims["positions"] == ["lanes", "answer_depth"]
    assert dims["noise"][:2] == ["lanes", "answer_depth"]


def test_manifest_records_identity_signature_and_profiles(exported):
    path, manifest, _ = exported
    on_disk = json.loads(manifest_path(path).read_text())
    assert on_disk == manifest
    assert manifest_path(path).name == "tiny.onnx.json"
    for field, value in IDENTITY.items():
        assert manifest[field] == value
    assert manifest["opset"] == 17
    assert manifest["profiles"]["prompt_len"] == {"min": 1, "opt": 512, "max": 4096}
    assert manifest["profiles"]["answer_depth"] == {"min": 1, "opt": 8192, "max": 8192}
    assert [i["name"] for i in manifest["inputs"]] == list(INPUT_NAMES)
    assert [o["name"] for o in manifest["outputs"]] == list(OUTPUT_NAMES)
    assert manifest["exporter"]["torch"] == torch.__version__
    assert manifest["lm_head_shape"] == [VOCAB, D_BASE]


@pytest.mark.parametrize(
    ("plens", "depths"),
    [([11, 2, 6], [40, 13, 29]), ([1], [1]), ([3, 9, 1, 5], [300, 1, 77, 300])],
)
def test_ort_equals_eager_decoder_at_other_shapes_greedy(decoder, exported, plens, depths):
    _, _, session = exported
    k, d = len(depths), max(depths)
    rows, lens, lm_head = lanes(k, plens, seed=k + d)
    noise = gumbel_noise((k, d, 8), seed=1) * 100.0  # temperature 0 must ignore any noise
    ref, got = run_both(decoder, session, rows, lens, depths, lm_head, torch.zeros(k), noise)
    assert_parity(ref, got, depths)
    assert torch.equal(got[0], got[1])  # temperature 0: the emitted token is the argmax


def test_ort_equals_eager_decoder_when_sampling(decoder, exported):
    _, _, session = exported
    plens, depths = [4, 12, 7], [90, 33, 64]
    rows, lens, lm_head = lanes(3, plens, seed=5)
    temperature = torch.tensor([0.0, 0.7, 5.0])
    noise = gumbel_noise((3, 90, 8), seed=11)
    ref, got = run_both(decoder, session, rows, lens, depths, lm_head, temperature, noise)
    assert_parity(ref, got, depths)
    assert not torch.equal(got[0][2], got[1][2])  # the hot lane really sampled
    assert torch.equal(got[0][0], got[1][0])  # the greedy lane did not


def test_in_graph_eos_scan_matches_at_a_forced_eos(decoder, exported):
    _, _, session = exported
    plens, depths = [6, 3, 8, 2], [120, 60, 5, 120]
    rows, lens, lm_head = lanes(4, plens, seed=21)
    pos = torch.arange(120).expand(4, -1)
    with torch.no_grad():  # an EOS row aligned with the mean answer state: EOS gets emitted
        guess = decoder.guess_embed(lm_head) if decoder.cfg.refine else None
        lm_head[EOS] = decoder.hidden(rows, lens, pos, guess=guess).mean((0, 1)) * 3
    zeros = torch.zeros(4, 120, 8)
    ref, got = run_both(decoder, session, rows, lens, depths, lm_head, torch.zeros(4), zeros)
    assert_parity(ref, got, depths)
    assert (ref.eos_pos < NO_EOS).sum() >= 2  # the scan found real EOS positions


def test_candidate_filters_run_in_graph(decoder, exported):
    _, _, session = exported
    plens, depths = [4, 9, 6, 5], [40, 40, 40, 40]
    rows, lens, lm_head = lanes(4, plens, seed=8)
    with torch.no_grad():  # make EOS the greedy top-1 nearly everywhere
        guess = decoder.guess_embed(lm_head) if decoder.cfg.refine else None
        pos = torch.arange(40).expand(4, -1)
        lm_head[EOS] = decoder.hidden(rows, lens, pos, guess=guess).mean((0, 1)) * 50
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    noise = gumbel_noise((4, 40, 8), seed=3)
    filters = Filters(
        torch.tensor([0, 1, 0, 0]),  # lane 1: top_k 1 = greedy
        torch.tensor([1.0, 1.0, 0.05, 1.0]),  # lane 2: a tight nucleus
        torch.tensor([0.0, 0.0, 0.0, 0.9]),  # lane 3: only near-best candidates
        torch.tensor([30, 0, 0, 0]),  # lane 0: no EOS before position 30
    )
    ref, got = run_both(decoder, session, rows, lens, depths, lm_head, temperature, noise, filters)
    assert_parity(ref, got, depths)
    tokens = got[0]
    assert EOS not in tokens[0, :30].tolist() and tokens[0, 30:].eq(EOS).any()
    assert torch.equal(tokens[1], got[1][1])  # top_k 1 samples nothing: the top-1
    assert torch.equal(tokens[2], got[1][2])  # a 0.05 nucleus keeps only the best too


def test_export_refuses_without_the_model_identity(decoder, tmp_path):
    with pytest.raises(OnnxGraphError, match="missing"):
        export_readout(decoder, tmp_path / "x.onnx", identity={"decoder_digest": "d"})


def test_tensorrt_profiles_come_from_the_manifest(exported):
    shapes = tensorrt_build.profile_shapes(exported[1])
    assert shapes["rows"] == ((1, 1, D_BASE), (8, 512, D_BASE), (8, 4096, D_BASE))
    assert shapes["noise"][2] == (8, 8192, 8)
    assert shapes["lm_head"] == ((VOCAB, D_BASE),) * 3


def _tensorrt_installed() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_tensorrt_installed(), reason="TensorRT is installed")
def test_tensorrt_builder_says_it_is_not_installed(exported, tmp_path):
    with pytest.raises(OnnxGraphError, match=r"TensorRT not installed \(optional extra"):
        tensorrt_build.build_engine(exported[0], tmp_path / "x.plan")


@pytest.mark.gpu
@pytest.mark.skipif(not _tensorrt_installed(), reason="TensorRT not installed")
def test_tensorrt_engine_builds(exported, tmp_path):  # pragma: no cover - optional extra
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = tensorrt_build.build_engine(exported[0], tmp_path / "tiny.plan", workspace_gib=1.0)
    assert out.stat().st_size > 0


def test_a_graph_of_an_older_format_asks_for_a_re_export(exported, tmp_path):
    """Format /2 added the candidate filters as inputs and log-probabilities as outputs: a
    graph exported before is refused with the command that replaces it."""
    import json
    import shutil

    from stateblock.engines.onnx_graph import manifest_path, read_graph_manifest

    path, _, _ = exported
    old = tmp_path / "old.onnx"
    shutil.copy(path, old)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["format"] = "stateblock-readout-onnx/1"
    manifest_path(old).write_text(json.dumps(manifest))
    with pytest.raises(OnnxGraphError, match="re-export with `stateblock export`"):
        read_graph_manifest(old)
