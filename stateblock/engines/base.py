"""What every readout engine takes and gives: lanes in, answers out.

An engine turns the verified lanes of one block into answers in one decoder execution.
It knows nothing about NATS, the registry or tokenisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from stateblock.model.rows import block_lanes, split_lanes
from stateblock.model.slots import SlotVerified
from stateblock.model.vocab import Filters
from stateblock.protocol import envelope, layouts
from stateblock.protocol.envelope import ModelIdentity
from stateblock.protocol.sampling import NO_EOS, TOP_K_SAMPLE, SamplingParams, seed_of

__all__ = [
    "TOP_K_SAMPLE",
    "LaneLogprobs",
    "LaneRequest",
    "LaneResult",
    "ReadoutEngine",
    "UnknownEngine",
    "UnservedDecoder",
    "lane_requests",
    "lane_filters",
    "lane_result",
]


class UnknownEngine(ValueError):
    pass


class UnservedDecoder(ValueError):
    """A decoder the named readout engine does not serve (one that reads the prompt's
    token ids, where the engine takes rows alone)."""


@dataclass(frozen=True)
class LaneRequest:
    rows: Tensor  # (P, d_base), one lane's captured rows
    depth: int  # answer positions to read (the lane's answer_depth, the request's max_tokens)
    # the one sampling type (stateblock.protocol.sampling), as the signed header carries it
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # (P,) int64: the prompt's token ids, where the block carries them (Lane.prompt_token_ids)
    prompt_ids: Tensor | None = None

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def seed(self) -> int | None:
        return seed_of(self.sampling)

    @property
    def selects(self) -> bool:
        """Whether the lane's tokens come from its 8 candidates rather than the top-1:
        it samples, or EOS is suppressed before min_tokens (which greedy also obeys)."""
        return self.sampling.temperature > 0 or self.sampling.min_tokens > 0


def lane_filters(lanes: Sequence[LaneRequest], device=None) -> Filters:
    """The lanes' candidate filters as (K,) tensors (stateblock.model.vocab.candidate_mask)."""
    s = [lane.sampling for lane in lanes]
    return Filters(
        torch.tensor([x.top_k for x in s], dtype=torch.int64, device=device),
        torch.tensor([x.top_p if x.HasField("top_p") else 1.0 for x in s], device=device),
        torch.tensor([x.min_p for x in s], dtype=torch.float32, device=device),
        torch.tensor([x.min_tokens for x in s], dtype=torch.int64, device=device),
    )


@dataclass(frozen=True)
class LaneLogprobs:
    """Exact log-probabilities per read position (raw logits, before temperature and
    filters): of the emitted token, and of the top-2 candidates by logit."""

    token: tuple[float, ...]
    top1_ids: tuple[int, ...]
    top1: tuple[float, ...]
    top2_ids: tuple[int, ...]
    top2: tuple[float, ...]  # top1 - margin: the same pass's runner-up


@dataclass(frozen=True)
class LaneResult:
    token_ids: tuple[int, ...]  # cut at the first EOS (excluded) or at depth
    eos_pos: int  # first EOS position, or NO_EOS (also under ignore_eos)
    margins: tuple[float, ...]  # top-1 minus top-2 logit per read position (EOS included)
    logprobs: LaneLogprobs | None = None  # when the lane asked for them, same positions


# per position: (emitted token's logprob, top-1 id, top-1 logprob, top-2 id, top-2 logprob)
RawLogprobs = tuple[list[float], list[int], list[float], list[int], list[float]]


def lane_result(
    lane: LaneRequest,
    tokens: list[int],
    margins: list[float],
    eos: int,
    logprobs: RawLogprobs | None = None,
) -> LaneResult:
    """One lane's answer from its read positions, the same cut in every engine: at the first
    EOS (excluded; its margin kept, it is part of the answer) or at the depth. Under
    ignore_eos every position up to the depth is the answer and no EOS is reported.
    Log-probabilities are kept for the margins' positions when the lane asked for them."""
    depth = lane.depth
    if lane.sampling.ignore_eos or eos >= depth:
        ids, eos, n = tuple(tokens[:depth]), NO_EOS, depth
    else:
        ids, n = tuple(tokens[:eos]), eos + 1
    lp = None
    if logprobs is not None and lane.sampling.HasField("logprobs"):
        token, top1_ids, top1, top2_ids, top2 = (x[:n] for x in logprobs)
        lp = LaneLogprobs(tuple(token), tuple(top1_ids), tuple(top1), tuple(top2_ids), tuple(top2))
    return LaneResult(ids, eos, tuple(margins[:n]), lp)


class ReadoutEngine(Protocol):
    name: str
    identity: ModelIdentity  # the pieces a block must have been captured for

    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]: ...

    def warm_up(self) -> None: ...


def lane_requests(
    block: envelope.VerifiedBlock | envelope.HeaderVerified | SlotVerified,
) -> list[LaneRequest]:
    """The engine input of a (header-)verified block, lane by lane (also what an audit
    re-reads); a slot's rows stay on their device, split by view."""
    header = block.header
    if isinstance(block, SlotVerified):
        lanes = split_lanes(block.rows, header.layout)
    else:
        lanes = block_lanes(block)
    holders = layouts.lane_rows(header.layout)  # the lanes whose rows and prompt ids each reads
    return [
        LaneRequest(
            rows=rows,
            depth=lane.answer_depth,
            sampling=s,
            prompt_ids=torch.tensor(held.prompt_token_ids, dtype=torch.int64)
            if held.prompt_token_ids
            else None,
        )
        for rows, lane, held, s in zip(
            lanes, header.layout.lanes, holders, header.sampling, strict=True
        )  # fmt: skip
    ]
