"""Readout engines: one protocol, selected by name at start-up; an unknown name fails closed.

An engine turns the verified lanes of one block into answers in one decoder execution.
It knows nothing about NATS, the registry or tokenisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from stateblock.capture import pad_lanes
from stateblock.checkpoint import load_decoder
from stateblock.envelope import ModelIdentity
from stateblock.readout import ReadoutDecoder
from stateblock.serving import ServingModel
from stateblock.vocab import NO_EOS, gumbel_noise

TOP_K_SAMPLE = 8  # the decoder's Gumbel top-k width


class UnknownEngine(ValueError):
    pass


@dataclass(frozen=True)
class LaneRequest:
    rows: Tensor  # (P, d_base), one lane's captured rows
    depth: int  # answer positions to read (max_tokens)
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False  # read all `depth` positions whatever EOS comes (vLLM's flag)


@dataclass(frozen=True)
class LaneResult:
    token_ids: tuple[int, ...]  # cut at the first EOS (excluded) or at depth
    eos_pos: int  # first EOS position, or NO_EOS (also under ignore_eos)
    margins: tuple[float, ...]  # top-1 minus top-2 logit per read position (EOS included)


def lane_result(lane: LaneRequest, tokens: list[int], margins: list[float], eos: int) -> LaneResult:
    """One lane's answer from its read positions, the same cut in every engine: at the first
    EOS (excluded; its margin kept, it is part of the answer) or at the depth. Under
    ignore_eos every position up to the depth is the answer and no EOS is reported."""
    depth = lane.depth
    if lane.ignore_eos or eos >= depth:
        return LaneResult(tuple(tokens[:depth]), NO_EOS, tuple(margins[:depth]))
    return LaneResult(tuple(tokens[:eos]), eos, tuple(margins[: eos + 1]))


class ReadoutEngine(Protocol):
    name: str
    identity: ModelIdentity  # the pieces a block must have been captured for

    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]: ...

    def warm_up(self) -> None: ...


class ReferenceEngine:
    """Eager PyTorch: the definition of a correct answer."""

    name = "reference"

    def __init__(
        self,
        decoder: ReadoutDecoder,
        lm_head: Tensor,
        identity: ModelIdentity,
        *,
        eos_token_id: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self._decoder = decoder
        self._act = next(decoder.parameters()).dtype  # rows enter in the decoder's dtype
        self._lm_head = lm_head  # resident, bound by reference
        self.identity = identity
        self._eos = eos_token_id
        self._device = torch.device(device)

    @classmethod
    def load(cls, model: ServingModel, device: str = "cpu") -> ReferenceEngine:
        decoder, manifest = load_decoder(
            model.decoder_dir,
            base_dir=model.base_dir,
            lm_head=model.lm_head,
            device=device,
            dtype=model.lm_head.dtype,
        )
        eos = manifest["decoder_config"]["eos_token_id"]
        return cls(
            decoder, model.lm_head.to(device), model.identity, eos_token_id=eos, device=device
        )

    def warm_up(self) -> None:
        """One throwaway readout at start-up, not on the first request."""
        rows = torch.zeros(4, self._lm_head.shape[1], dtype=self._act)
        self.readout([LaneRequest(rows=rows, depth=16)])

    @torch.inference_mode()
    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]:
        dev = self._device
        rows, prompt_lens = pad_lanes([lane.rows.to(dev, self._act) for lane in lanes])
        k = len(lanes)
        d = max(lane.depth for lane in lanes)
        positions = torch.arange(d, device=dev).expand(k, d)  # (K, D)
        depths = torch.tensor([lane.depth for lane in lanes], device=dev)
        temperature = noise = None
        if any(lane.temperature > 0 for lane in lanes):
            temperature = torch.tensor([lane.temperature for lane in lanes], device=dev)
            noise = torch.stack(  # (K, D, 8): per-lane noise, so a seed fixes its lane alone
                [gumbel_noise((d, TOP_K_SAMPLE), lane.seed) for lane in lanes]
            ).to(dev)
        out = self._decoder(
            rows,
            prompt_lens.to(dev),
            positions,
            depths,
            self._lm_head,
            eos_token_id=self._eos,
            temperature=temperature,
            noise=noise,
        )
        tokens = out.tokens.cpu().tolist()
        margins = out.margin.float().cpu().tolist()
        eos_pos = out.eos_pos.cpu().tolist()
        return [
            lane_result(lane, tokens[i], margins[i], int(eos_pos[i]))
            for i, lane in enumerate(lanes)
        ]


def _load_onnx(model: ServingModel, device: str = "cpu") -> ReadoutEngine:
    # imported here: onnxruntime loads only when this engine is selected
    from readout_svc.engine_onnx import OnnxEngine

    return OnnxEngine.load(model, device)


def _load_torch(model: ServingModel, device: str = "cpu", **options) -> ReadoutEngine:
    # imported here: engine_torch imports this module (LaneRequest, LaneResult)
    from readout_svc.engine_torch import TorchEngine

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
# STATEBLOCK_MATMUL_PRECISION and STATEBLOCK_READOUT_HEAD); any other is refused.
ENGINE_OPTIONS: dict[str, frozenset[str]] = {"torch": frozenset({"matmul_precision", "head"})}


def create_engine(
    name: str, model: ServingModel, device: str = "cpu", **options: object
) -> ReadoutEngine:
    """The named engine, loaded against `model`, with the settings it takes."""
    factory = require_engine(name)
    extra = set(options) - ENGINE_OPTIONS.get(name, frozenset())
    if extra:
        raise ValueError(f"readout engine {name!r} takes no setting {sorted(extra)}")
    return factory(model, device, **options)
