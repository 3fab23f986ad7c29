"""Optional: a TensorRT engine built from the exported ONNX readout graph.

The optional extra `[tensorrt]`, unverified in CI (no GPU there, and no TensorRT wheel is
installed by default). `tensorrt` is imported inside `build_engine`, so importing this
module never needs it, and nothing imports this module at module level.

One optimisation profile from the graph's manifest (`profiles`: min/opt/max of lanes,
prompt_len and answer_depth); the lm_head input is static (V, d_base), so it is given the
same shape for min, opt and max.
"""

from __future__ import annotations

from pathlib import Path

from stateblock.engines.onnx_graph import OnnxGraphError, file_sha256, read_graph_manifest

NOT_INSTALLED = "TensorRT not installed (optional extra [tensorrt], unverified in CI)"


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise OnnxGraphError(NOT_INSTALLED) from e
    return tensorrt


def profile_shapes(manifest: dict) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Input name -> (min, opt, max) shapes, from the manifest's signature and profiles."""
    prof = manifest["profiles"]
    shapes = {}
    for spec in manifest["inputs"]:
        per_level = []
        for level in ("min", "opt", "max"):
            per_level.append(
                tuple(prof[d][level] if isinstance(d, str) else int(d) for d in spec["shape"])
            )
        shapes[spec["name"]] = tuple(per_level)
    return shapes


def build_engine(graph_path: str | Path, out: str | Path, *, workspace_gib: float = 8.0) -> Path:
    """Serialise a TensorRT engine for `graph_path` (checked against its manifest) to `out`."""
    trt = _import_tensorrt()
    graph_path = Path(graph_path)
    manifest = read_graph_manifest(graph_path)
    if file_sha256(graph_path) != manifest.get("onnx_sha256"):
        raise OnnxGraphError(f"{graph_path} does not match the SHA-256 in its manifest")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT >= 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise OnnxGraphError(f"TensorRT cannot parse {graph_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(manifest).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise OnnxGraphError(f"TensorRT failed to build an engine from {graph_path}")
    out = Path(out)
    out.write_bytes(bytes(plan))
    return out
