"""The `onnx` readout engine: the exported opset-17 graph run with ONNX Runtime.

Where the graph comes from: `<decoder_dir>/readout.onnx` (and its manifest
`readout.onnx.json`), beside the decoder checkpoint the service loads, written by
`stateblock export --decoder DIR --base DIR`, whose `--out` defaults to that path.
`OnnxEngine.load(model, device, graph_path=...)` takes another path for callers that keep
graphs elsewhere. Nothing is exported at start-up: a missing graph is a start-up error
that names the command to run, because a silent export would hide which graph is served.

Fail closed at start-up: a missing or corrupt file, a manifest bound to another decoder,
base model, lm_head or tokenizer, a graph ONNX Runtime cannot load, or a signature other
than the exported one raises OnnxGraphError before the first request.

The lm_head is wrapped as an OrtValue once and passed as that input on every run; on the
CPU it shares memory with the served tensor (a float32 copy is made once only when the
base model is served in another dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog
import torch

from stateblock.engines.base import (
    TOP_K_SAMPLE,
    LaneRequest,
    LaneResult,
    lane_filters,
    lane_result,
)
from stateblock.engines.onnx_graph import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    OnnxGraphError,
    default_graph_path,
    verify_graph,
)
from stateblock.model.capture import pad_lanes
from stateblock.model.loading import ServingModel
from stateblock.model.vocab import gumbel_noise

FILTER_INPUTS = ("top_k", "top_p", "min_p", "min_tokens")  # lane_filters' order

log = structlog.get_logger("readout_svc")

# Explicit attention builds (lanes, heads, D, D + M) float32 scores; lanes are run in groups
# whose scores fit this budget. Exact: the decoder is prefix-causal and lanes independent.
DEFAULT_SCORE_BUDGET = 1 << 28  # elements (1 GiB of float32)


def _providers(device: str) -> list:
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise OnnxGraphError(
                f"device {device!r}: this onnxruntime has no CUDAExecutionProvider "
                "(install onnxruntime-gpu, or serve the onnx engine on cpu)"
            )
        index = int(device.partition(":")[2] or 0)
        return [("CUDAExecutionProvider", {"device_id": index})]
    raise OnnxGraphError(f"device {device!r} is not supported by the onnx engine")


class OnnxEngine:
    """The exported readout graph under ONNX Runtime; answers like ReferenceEngine."""

    name = "onnx"

    def __init__(
        self,
        model: ServingModel,
        graph_path: Path,
        *,
        device: str = "cpu",
        score_budget: int = DEFAULT_SCORE_BUDGET,
    ) -> None:
        import onnxruntime as ort

        expected = {
            "decoder_digest": model.identity.decoder_digest.hex(),
            "base_model_digest": model.identity.base_model_digest.hex(),
            "lm_head_digest": model.identity.lm_head_digest.hex(),
            "tokenizer_digest": model.manifest["tokenizer_digest"],
        }
        manifest = verify_graph(graph_path, expected)
        try:
            self._session = ort.InferenceSession(str(graph_path), providers=_providers(device))
        except Exception as e:  # onnxruntime raises its own exception types; one edge here
            raise OnnxGraphError(f"ONNX Runtime cannot load {graph_path}: {e}") from e
        inputs = tuple(i.name for i in self._session.get_inputs())
        outputs = tuple(o.name for o in self._session.get_outputs())
        if inputs != INPUT_NAMES or outputs != OUTPUT_NAMES:
            raise OnnxGraphError(
                f"{graph_path}: signature {inputs} -> {outputs} is not the exported one "
                f"{INPUT_NAMES} -> {OUTPUT_NAMES}"
            )
        if list(model.lm_head.shape) != manifest["lm_head_shape"]:
            raise OnnxGraphError(
                f"{graph_path}: lm_head {manifest['lm_head_shape']}, model has "
                f"{list(model.lm_head.shape)}"
            )
        cfg = manifest["decoder_config"]
        self.identity = model.identity
        self.graph_path = graph_path
        self._eos = ort.OrtValue.ortvalue_from_numpy(np.array([cfg["eos_token_id"]], np.int64))
        self._heads_x_latents = (cfg["n_heads"], cfg["n_latent"])
        self._score_budget = score_budget
        # Kept alive here: on the CPU the OrtValue reads this buffer without copying it.
        self._lm_head_np = model.lm_head.detach().to("cpu", torch.float32).contiguous().numpy()
        self._lm_head = ort.OrtValue.ortvalue_from_numpy(self._lm_head_np)
        self._ort = ort

    @classmethod
    def load(
        cls, model: ServingModel, device: str = "cpu", graph_path: str | Path | None = None
    ) -> OnnxEngine:
        path = Path(graph_path) if graph_path is not None else default_graph_path(model.decoder_dir)
        engine = cls(model, path, device=device)
        log.info("onnx readout engine loaded", graph=str(path), device=device)
        return engine

    def warm_up(self) -> None:
        """One throwaway readout at start-up, not on the first request."""
        rows = torch.zeros(4, self._lm_head_np.shape[1])
        self.readout([LaneRequest(rows=rows, depth=16)])

    def _groups(self, lanes: Sequence[LaneRequest]) -> list[list[int]]:
        """Lane indices in order, grouped so each group's attention scores fit the budget."""
        heads, latents = self._heads_x_latents
        groups: list[list[int]] = []
        depth = 0
        for i, lane in enumerate(lanes):
            d = max(depth, lane.depth)
            if groups and heads * d * (d + latents) * (len(groups[-1]) + 1) <= self._score_budget:
                groups[-1].append(i)
                depth = d
            else:
                groups.append([i])
                depth = lane.depth
        return groups

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        values = {k: self._ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
        values["lm_head"] = self._lm_head
        values["eos_token_id"] = self._eos
        outs = self._session.run_with_ort_values(list(OUTPUT_NAMES), values)
        return [o.numpy() for o in outs]

    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]:
        k = len(lanes)
        d = max(lane.depth for lane in lanes)
        temperature = np.array([lane.temperature for lane in lanes], np.float32)
        filters = [f.cpu().numpy() for f in lane_filters(lanes)]
        if (temperature > 0).any():
            # the same per-lane draws as ReferenceEngine, at the same (D, 8) shape, so a
            # seed gives the same tokens on both engines
            noise = torch.stack([gumbel_noise((d, TOP_K_SAMPLE), lane.seed) for lane in lanes])
            noise_np = noise.to(torch.float32).numpy()
        else:  # temperature 0 ignores the noise: zeros, not a draw
            noise_np = np.zeros((k, d, TOP_K_SAMPLE), np.float32)
        results: list[LaneResult | None] = [None] * k
        for group in self._groups(lanes):
            rows, prompt_lens = pad_lanes([lanes[i].rows.to(torch.float32) for i in group])
            gd = max(lanes[i].depth for i in group)
            tokens, top1, top2, margin, eos_pos, top1_lp, token_lp = self._run(
                {
                    "rows": rows.cpu().numpy(),
                    "prompt_lens": prompt_lens.numpy(),
                    "positions": np.broadcast_to(np.arange(gd), (len(group), gd)).copy(),
                    "depths": np.array([lanes[i].depth for i in group], np.int64),
                    "temperature": temperature[group],
                    "noise": np.ascontiguousarray(noise_np[group, :gd]),
                    **{name: f[group] for name, f in zip(FILTER_INPUTS, filters, strict=True)},
                }
            )
            for j, i in enumerate(group):
                lp = (
                    token_lp[j].tolist(),
                    top1[j].tolist(),
                    top1_lp[j].tolist(),
                    top2[j].tolist(),
                    (top1_lp[j] - margin[j]).tolist(),
                )
                results[i] = lane_result(
                    lanes[i], tokens[j].tolist(), margin[j].tolist(), int(eos_pos[j]), lp
                )
        return [r for r in results if r is not None]
