"""The reference engine: eager PyTorch, the definition of a correct answer.

It has no `cohort_key`: the readout reads each block in an execution of its own. Its
executions take the lanes' own shapes, and the matrix products (BLAS on a CPU, cuBLAS on a
GPU) sum a product of 40 rows otherwise than one of 10 (on a CPU with more than one thread,
the very first projection's last bits already differ), so a block read beside others would
not read bit for bit as alone. The torch engine fixes its shapes per depth instead and is
combined (stateblock/engines/torch_options.py: execution_lanes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stateblock.engines.base import (
    TOP_K_SAMPLE,
    LaneRequest,
    LaneResult,
    lane_filters,
    lane_result,
)
from stateblock.model.capture import pad_lanes
from stateblock.model.checkpoint import build_decoder
from stateblock.model.decoder import ReadoutDecoder
from stateblock.model.loading import ServingModel
from stateblock.model.vocab import gumbel_noise
from stateblock.protocol.envelope import ModelIdentity


class ReferenceEngine:
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
        decoder = build_decoder(
            model.decoder_dir, model.manifest, device=device, dtype=model.lm_head.dtype
        )
        manifest = model.manifest
        eos = manifest["decoder_config"]["eos_token_id"]
        return cls(
            decoder, model.lm_head.to(device), model.identity, eos_token_id=eos, device=device
        )

    def warm_up(self) -> None:
        """One throwaway readout at start-up, not on the first request."""
        rows = torch.zeros(4, self._lm_head.shape[1], dtype=self._act)
        ids = torch.zeros(4, dtype=torch.int64) if self._decoder.reads_ids else None
        self.readout([LaneRequest(rows=rows, depth=16, prompt_ids=ids)])

    def _prompt_ids(self, lanes: Sequence[LaneRequest], width: int) -> Tensor | None:
        """(K, width) the lanes' prompt ids, right-padded, for a decoder that reads them."""
        if not self._decoder.reads_ids:
            return None
        ids = torch.zeros(len(lanes), width, dtype=torch.int64)
        for i, lane in enumerate(lanes):
            if lane.prompt_ids is None or lane.prompt_ids.numel() != lane.rows.shape[0]:
                raise ValueError(f"lane {i}: the decoder reads the prompt's token ids, one a row")
            ids[i, : lane.prompt_ids.numel()] = lane.prompt_ids
        if int(ids.max()) >= self._lm_head.shape[0]:
            raise ValueError("a prompt id is past the vocabulary")
        return ids.to(self._device)

    @torch.inference_mode()
    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]:
        dev = self._device
        rows, prompt_lens = pad_lanes([lane.rows.to(dev, self._act) for lane in lanes])
        k = len(lanes)
        d = max(lane.depth for lane in lanes)
        positions = torch.arange(d, device=dev).expand(k, d)  # (K, D)
        depths = torch.tensor([lane.depth for lane in lanes], device=dev)
        temperature = noise = filters = None
        if any(lane.selects for lane in lanes):
            temperature = torch.tensor([lane.temperature for lane in lanes], device=dev)
            noise = torch.stack(  # (K, D, 8): per-lane noise, so a seed fixes its lane alone
                [gumbel_noise((d, TOP_K_SAMPLE), lane.seed) for lane in lanes]
            ).to(dev)
            filters = lane_filters(lanes, dev)
        out = self._decoder(
            rows,
            prompt_lens.to(dev),
            positions,
            depths,
            self._lm_head,
            eos_token_id=self._eos,
            temperature=temperature,
            noise=noise,
            filters=filters,
            prompt_ids=self._prompt_ids(lanes, rows.shape[1]),
        )
        tokens = out.tokens.cpu().tolist()
        margins = out.margin.float().cpu().tolist()
        eos_pos = out.eos_pos.cpu().tolist()
        top2_lp = out.top1_logprob - out.margin  # the same pass's runner-up
        lp = [
            x.cpu().tolist()
            for x in (out.token_logprob, out.top1, out.top1_logprob, out.top2, top2_lp)
        ]
        return [
            lane_result(lane, tokens[i], margins[i], int(eos_pos[i]), tuple(x[i] for x in lp))
            for i, lane in enumerate(lanes)
        ]
