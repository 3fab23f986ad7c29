"""ONNX opset-17 export of the readout graph, and the manifest that binds it to one model.

`stateblock export` writes two files:

- `FILE.onnx`: `ReadoutDecoder` with explicit MatMul/Softmax attention (no fused attention
  op can bake in a static sequence shape), functional sinusoids computed from the
  `positions` input, the chunked vocabulary projection with its running top-2 merge and
  the first-EOS scan all in-graph. The base model's lm_head is a graph input, never an
  initializer: it stays resident in the runtime and is bound once, not copied per request.
- `FILE.onnx.json` (the `.onnx` path plus `.json`): the manifest. Decoder, base-model,
  lm_head and tokenizer digests, the file's own SHA-256, opset, input/output signature,
  the optimisation profiles and the exporter's versions. An engine refuses a graph whose
  manifest does not match the model it serves (`verify_graph`).

The default location is `<decoder_dir>/readout.onnx`, beside the checkpoint it was
exported from, which is where the `onnx` readout engine looks for it. Export is always an
explicit step; nothing exports silently at service start-up.

The graph has one signature: temperature, noise and the candidate filters (top_k, top_p,
min_p, min_tokens) are always inputs (temperature 0 is exact argmax, whatever the noise;
the filters' neutral values keep every candidate), so every request shares one engine.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from stateblock.model.checkpoint import decoder_digest, load_decoder
from stateblock.model.decoder import ReadoutDecoder
from stateblock.model.vocab import Filters
from stateblock.protocol.sampling import TOP_K_SAMPLE

FORMAT = "stateblock-readout-onnx/2"  # /2: candidate filters in, log-probabilities out
OPSET = 17
GRAPH_FILE = "readout.onnx"
IDENTITY_FIELDS = ("decoder_digest", "base_model_digest", "lm_head_digest", "tokenizer_digest")

INPUT_NAMES = (
    "rows",  # (lanes, prompt_len, d_base) float32, lanes padded to the longest prompt
    "prompt_lens",  # (lanes,) int64
    "positions",  # (lanes, answer_depth) int64, normally arange(answer_depth)
    "depths",  # (lanes,) int64, positions read per lane
    "lm_head",  # (V, d_base) float32, the base model's resident output embedding
    "eos_token_id",  # (1,) int64
    "temperature",  # (lanes,) float32, 0 = argmax
    "noise",  # (lanes, answer_depth, 8) float32 standard Gumbel
    "top_k",  # (lanes,) int64, 0 = all 8 candidates
    "top_p",  # (lanes,) float32, 1 = no nucleus cut
    "min_p",  # (lanes,) float32, 0 = no cut
    "min_tokens",  # (lanes,) int64, EOS suppressed before this position
)
OUTPUT_NAMES = ("tokens", "top1", "top2", "margin", "eos_pos", "top1_logprob", "token_logprob")

# Dynamic axes by name: what a runtime may vary without re-export.
DYNAMIC_AXES: dict[str, dict[int, str]] = {
    "rows": {0: "lanes", 1: "prompt_len"},
    "prompt_lens": {0: "lanes"},
    "positions": {0: "lanes", 1: "answer_depth"},
    "depths": {0: "lanes"},
    "temperature": {0: "lanes"},
    "noise": {0: "lanes", 1: "answer_depth"},
    "top_k": {0: "lanes"},
    "top_p": {0: "lanes"},
    "min_p": {0: "lanes"},
    "min_tokens": {0: "lanes"},
    "tokens": {0: "lanes", 1: "answer_depth"},
    "top1": {0: "lanes", 1: "answer_depth"},
    "top2": {0: "lanes", 1: "answer_depth"},
    "margin": {0: "lanes", 1: "answer_depth"},
    "eos_pos": {0: "lanes"},
    "top1_logprob": {0: "lanes", 1: "answer_depth"},
    "token_logprob": {0: "lanes", 1: "answer_depth"},
}
# min / opt / max per dynamic axis, for builders that need them (TensorRT profiles).
PROFILES: dict[str, tuple[int, int, int]] = {
    "lanes": (1, 8, 8),
    "prompt_len": (1, 512, 4096),
    "answer_depth": (1, 8192, 8192),
}
# Trace shapes: small, odd and unequal, so a size accidentally baked into the graph shows
# up as a wrong answer at any other shape (the tests run other shapes).
_TRACE_LANES, _TRACE_PROMPT, _TRACE_DEPTH = 2, 5, 7


class OnnxGraphError(Exception):
    """An exported readout graph cannot be written, read or used."""


class OnnxGraphMismatch(OnnxGraphError):
    def __init__(self, path: Path, field: str, expected: str, actual: str) -> None:
        super().__init__(
            f"ONNX readout graph {path} does not match the loaded model: its {field} is "
            f"{actual[:16]}..., the service loaded {expected[:16]}... "
            "(re-export with `stateblock export`)"
        )
        self.field = field


class ReadoutGraph(nn.Module):
    """The decoder with the exported signature: explicit attention, always temperature+noise.

    With temperature present the decoder keeps a top-8 (for Gumbel selection); its first
    two entries are exactly the top-2 a greedy call returns, so top1/top2/margin agree.
    """

    def __init__(self, decoder: ReadoutDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        positions: Tensor,
        depths: Tensor,
        lm_head: Tensor,
        eos_token_id: Tensor,
        temperature: Tensor,
        noise: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        min_p: Tensor,
        min_tokens: Tensor,
    ) -> tuple[Tensor, ...]:
        out = self.decoder(
            rows,
            prompt_lens,
            positions,
            depths,
            lm_head,
            eos_token_id=eos_token_id,
            temperature=temperature,
            noise=noise,
            impl="explicit",
            filters=Filters(top_k, top_p, min_p, min_tokens),
        )
        return tuple(out)


def manifest_path(graph_path: str | Path) -> Path:
    p = Path(graph_path)
    return p.with_name(p.name + ".json")


def default_graph_path(decoder_dir: str | Path) -> Path:
    return Path(decoder_dir) / GRAPH_FILE


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _trace_inputs(decoder: ReadoutDecoder) -> tuple[Tensor, ...]:
    cfg = decoder.cfg
    k, p, d = _TRACE_LANES, _TRACE_PROMPT, _TRACE_DEPTH
    return (
        torch.zeros(k, p, cfg.d_base),
        torch.tensor([p, p - 2]),
        torch.arange(d).expand(k, d).contiguous(),
        torch.tensor([d, d - 3]),
        torch.zeros(cfg.vocab_size, cfg.d_base),  # values never enter the graph
        torch.tensor([cfg.eos_token_id]),
        torch.zeros(k),
        torch.zeros(k, d, TOP_K_SAMPLE),
        torch.tensor([0, 3]),
        torch.tensor([1.0, 0.5]),
        torch.tensor([0.0, 0.1]),
        torch.tensor([0, 2]),
    )


def _signature(decoder: ReadoutDecoder) -> tuple[list[dict], list[dict]]:
    cfg = decoder.cfg
    shapes = {
        "rows": ["lanes", "prompt_len", cfg.d_base],
        "prompt_lens": ["lanes"],
        "positions": ["lanes", "answer_depth"],
        "depths": ["lanes"],
        "lm_head": [cfg.vocab_size, cfg.d_base],
        "eos_token_id": [1],
        "temperature": ["lanes"],
        "noise": ["lanes", "answer_depth", TOP_K_SAMPLE],
        "top_k": ["lanes"],
        "top_p": ["lanes"],
        "min_p": ["lanes"],
        "min_tokens": ["lanes"],
    }
    floats = {"rows", "lm_head", "temperature", "noise", "margin", "top_p", "min_p"}
    floats |= {"top1_logprob", "token_logprob"}
    out_shapes = {name: ["lanes", "answer_depth"] for name in OUTPUT_NAMES}
    out_shapes["eos_pos"] = ["lanes"]

    def spec(name: str, shape: list) -> dict:
        return {"name": name, "dtype": "float32" if name in floats else "int64", "shape": shape}

    return (
        [spec(n, shapes[n]) for n in INPUT_NAMES],
        [spec(n, out_shapes[n]) for n in OUTPUT_NAMES],
    )


def export_readout(decoder: ReadoutDecoder, out: str | Path, *, identity: dict[str, str]) -> dict:
    """Write `out` (.onnx) and its manifest for `decoder`; returns the manifest.

    identity: the four IDENTITY_FIELDS digests (hex) the graph is bound to.
    """
    import onnx

    missing = [f for f in IDENTITY_FIELDS if not identity.get(f)]
    if missing:
        raise OnnxGraphError(f"export needs the model identity; missing {missing}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a copy: Module.to is in place, and the caller's decoder may be serving on a GPU
    graph = ReadoutGraph(copy.deepcopy(decoder).to("cpu", torch.float32).eval())
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns where Python ints come from the vocabulary size (chunk bounds,
        # per-chunk k) and the head width: both fixed per base model, so constants are
        # right there. Sizes from lanes, prompt_len and answer_depth stay symbolic; the
        # tests run the graph at shapes other than the trace shapes to prove it.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        try:
            # TorchScript exporter: the dynamo one needs onnxscript and guards the
            # data-dependent masks; this one is deprecated upstream but exact here.
            torch.onnx.export(
                graph,
                _trace_inputs(decoder),
                str(out),
                input_names=list(INPUT_NAMES),
                output_names=list(OUTPUT_NAMES),
                opset_version=OPSET,
                dynamic_axes=DYNAMIC_AXES,
                do_constant_folding=True,
                dynamo=False,
            )
        except Exception as e:  # the exporter raises many types; one error at this edge
            raise OnnxGraphError(f"ONNX export of the readout decoder failed: {e}") from e
    try:
        onnx.checker.check_model(str(out))
    except onnx.checker.ValidationError as e:
        raise OnnxGraphError(f"exported graph {out} fails the ONNX checker: {e}") from e
    inputs, outputs = _signature(decoder)
    manifest = {
        "format": FORMAT,
        "opset": OPSET,
        **{f: identity[f] for f in IDENTITY_FIELDS},
        "decoder_config": decoder.cfg.to_dict(),
        "lm_head_shape": [decoder.cfg.vocab_size, decoder.cfg.d_base],
        "inputs": inputs,
        "outputs": outputs,
        "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in DYNAMIC_AXES.items()},
        "profiles": {
            name: dict(zip(("min", "opt", "max"), v, strict=True)) for name, v in PROFILES.items()
        },
        "attention": "explicit",
        "exporter": {"torch": torch.__version__, "onnx": onnx.__version__, "mode": "torchscript"},
        "onnx_sha256": file_sha256(out),
    }
    manifest_path(out).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def export_checkpoint(decoder_dir: str | Path, base_dir: str | Path, out: str | Path) -> dict:
    """Export a decoder checkpoint after checking it against its base model (lm_head included)."""
    from stateblock.model.capture import lm_head_weight
    from stateblock.model.loading import load_base

    model, _tok = load_base(base_dir)
    decoder, manifest = load_decoder(decoder_dir, base_dir=base_dir, lm_head=lm_head_weight(model))
    identity = {f: manifest[f] for f in IDENTITY_FIELDS if f != "decoder_digest"}
    identity["decoder_digest"] = decoder_digest(decoder_dir)  # load_decoder checked this
    return export_readout(decoder, out, identity=identity)


def read_graph_manifest(graph_path: str | Path) -> dict:
    path = manifest_path(graph_path)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OnnxGraphError(f"cannot read ONNX graph manifest {path}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise OnnxGraphError(
            f"{path}: format {manifest.get('format')!r}, this engine reads {FORMAT!r} "
            "(re-export with `stateblock export`)"
        )
    if manifest.get("opset") != OPSET:
        raise OnnxGraphError(f"{path}: opset {manifest.get('opset')!r}, expected {OPSET}")
    return manifest


def verify_graph(graph_path: str | Path, expected: dict[str, str]) -> dict:
    """The graph's manifest, after checking the file's digest and its model identity.

    expected: the IDENTITY_FIELDS digests (hex) of the model the caller serves.
    """
    path = Path(graph_path)
    if not path.is_file():
        raise OnnxGraphError(
            f"no ONNX readout graph at {path}: export one with "
            f"`stateblock export --out {path}` (optionally --decoder/--base)"
        )
    manifest = read_graph_manifest(path)
    if file_sha256(path) != manifest.get("onnx_sha256"):
        raise OnnxGraphError(f"{path} does not match the SHA-256 in its manifest (corrupt?)")
    for field in IDENTITY_FIELDS:
        if manifest.get(field) != expected[field]:
            raise OnnxGraphMismatch(path, field, expected[field], str(manifest.get(field)))
    return manifest
