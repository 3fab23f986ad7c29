"""Readout engines: one protocol, selected by name at start-up; an unknown name fails closed.

`reference` (eager PyTorch, the definition of correct), `torch` (the GPU fast path) and
`onnx` (the opset-17 graph under ONNX Runtime). docs/ARCHITECTURE.md says who uses them.
"""

from __future__ import annotations

from collections.abc import Callable

from stateblock.engines.base import (
    TOP_K_SAMPLE,
    LaneRequest,
    LaneResult,
    ReadoutEngine,
    UnknownEngine,
    UnservedDecoder,
    lane_requests,
    lane_result,
)
from stateblock.engines.reference import ReferenceEngine
from stateblock.model.loading import ServingModel

__all__ = [
    "ENGINES",
    "TOP_K_SAMPLE",
    "LaneRequest",
    "LaneResult",
    "ReadoutEngine",
    "ReferenceEngine",
    "UnknownEngine",
    "UnservedDecoder",
    "create_engine",
    "lane_requests",
    "lane_result",
    "require_engine",
]


def _load_onnx(model: ServingModel, device: str = "cpu") -> ReadoutEngine:
    # imported here: onnxruntime loads only when this engine is selected
    from stateblock.engines.onnx_engine import OnnxEngine

    return OnnxEngine.load(model, device)


def _load_torch(model: ServingModel, device: str = "cpu", **options) -> ReadoutEngine:
    # imported here: Triton and the CUDA-graph machinery load only when selected
    from stateblock.engines.torch_engine import TorchEngine

    return TorchEngine.load(model, device, **options)


ENGINES: dict[str, Callable[..., ReadoutEngine]] = {
    "reference": ReferenceEngine.load,
    "onnx": _load_onnx,
    "torch": _load_torch,
}


def require_engine(name: str) -> Callable[..., ReadoutEngine]:
    """Fail closed, before anything is loaded: an unknown engine never falls back."""
    factory = ENGINES.get(name)
    if factory is None:
        raise UnknownEngine(
            f"unknown readout engine {name!r} (STATEBLOCK_ENGINE); available: {sorted(ENGINES)}"
        )
    return factory


# The settings each engine takes beyond the model and device (the readout service's
# STATEBLOCK_MATMUL_PRECISION, _READOUT_HEAD and _GREEDY_DTYPE); any other is refused.
ENGINE_OPTIONS: dict[str, frozenset[str]] = {
    "torch": frozenset({"matmul_precision", "head", "greedy_dtype", "warm_up_to"})
}


# The engines that serve a decoder reading the prompt's token ids beside its rows (a copy
# head, rows that carry their tokens: the blocks then carry the ids); the torch engine's
# fused head and CUDA graphs and the ONNX graph take rows alone.
READS_PROMPT_IDS = frozenset({"reference"})


def create_engine(
    name: str, model: ServingModel, device: str = "cpu", **options: object
) -> ReadoutEngine:
    """The named engine, loaded against `model`, with the settings it takes."""
    factory = require_engine(name)
    extra = set(options) - ENGINE_OPTIONS.get(name, frozenset())
    if extra:
        raise ValueError(f"readout engine {name!r} takes no setting {sorted(extra)}")
    if points := model.manifest.get("decoder_config", {}).get("copy_point"):
        raise UnservedDecoder(
            f"the decoder at {model.decoder_dir} reads {points} of the base's attention maps "
            "from the prompt's last position (copy_point), which the capture service does not "
            "record into a block: no engine serves it; distil the readout without --copy-point"
        )
    if model.reads_prompt_ids and name not in READS_PROMPT_IDS:
        cfg = model.manifest["decoder_config"]
        raise UnservedDecoder(
            f"the decoder at {model.decoder_dir} reads the prompt's token ids (copy="
            f"{cfg.get('copy', '')!r}, row_tokens={cfg.get('row_tokens', False)}), which "
            f"readout engine {name!r} does not serve; engines that do: {sorted(READS_PROMPT_IDS)}"
        )
    return factory(model, device, **options)
